//! Which of this node's interfaces holds a local address: a probe's NIC is the one its TCP
//! socket's local address belongs to.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The interface `ip` is an address of (`getifaddrs`), if any.
pub fn interface_of(ip: IpAddr) -> Option<String> {
    let ip = ip.to_canonical();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list this function frees below, once.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut at = head;
    while !at.is_null() {
        // SAFETY: a node of the list getifaddrs made, alive until freeifaddrs.
        let ifa = unsafe { &*at };
        at = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points at a sockaddr whose family says which one it is.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                }
                _ => None,
            }
        };
        if addr == Some(ip) {
            // SAFETY: ifa_name is a NUL-terminated string of the list.
            found = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_str().ok().map(str::to_string);
            break;
        }
    }
    // SAFETY: the list getifaddrs returned, freed once; nothing of it is used after.
    unsafe { libc::freeifaddrs(head) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_are_los_and_a_foreign_one_is_nobodys() {
        assert_eq!(interface_of(IpAddr::V4(Ipv4Addr::LOCALHOST)).as_deref(), Some("lo"));
        // IPv4-mapped IPv6 (a dual-stack socket's local address) is the IPv4 address.
        assert_eq!(interface_of(IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped())).as_deref(), Some("lo"));
        assert_eq!(interface_of("192.0.2.77".parse().unwrap()), None);
    }
}
