//! One RDMA device through libibverbs: which device there is (or why none), its queue pair
//! brought to RTS against the peer's, memory regions registered for remote READs, and the
//! reader's READs of every piece into a registered buffer and on into the destination file.

use std::ffi::{c_void, CStr};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::ptr;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::control::{Endpoint, Region};
use super::{DEPTH, PIECE};
use crate::AgentError;

/// How long the reader waits for the next READ completion before it gives up.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(30);
/// The port both sides use (verbs ports are numbered from 1).
const PORT: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that the bindings leave out).
const LINK_LAYER_ETHERNET: u8 = 2;
/// Where the device is named when there is none.
const NO_DEVICE: &str = "no device";

/// The GID index to use on a RoCE port, from its table as `(index, type, gid)` where the type
/// is sysfs's `gid_attrs/types/N` ("RoCE v2", "IB/RoCE v1", or unknown): the first RoCE v2 GID
/// that is set (it routes over IP), else the first GID that is set.
pub fn choose_gid_index(table: &[(u8, Option<String>, [u8; 16])]) -> Option<u8> {
    let set = |gid: &[u8; 16]| gid.iter().any(|&b| b != 0);
    table
        .iter()
        .find(|(_, ty, gid)| set(gid) && ty.as_deref().is_some_and(|t| t.trim().eq_ignore_ascii_case("RoCE v2")))
        .or_else(|| table.iter().find(|(_, _, gid)| set(gid)))
        .map(|(i, _, _)| *i)
}

/// The first RDMA device this host has, or why there is none (no device, no libibverbs).
pub fn available() -> Result<String, String> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list, when not null, holds `n` device pointers
    // followed by null, and is freed once below after the name is copied out.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            return Err(list_error(errno()));
        }
        let first = if n > 0 && !(*list).is_null() { Some(device_name(*list)) } else { None };
        ibv_free_device_list(list);
        first.ok_or_else(no_device_message)
    }
}

/// Why libibverbs could not list devices at all (ENOSYS: the kernel has no uverbs).
fn list_error(e: std::io::Error) -> String {
    format!(
        "no RDMA device on this host (libibverbs cannot list devices: {e}; the kernel has no uverbs support): load ib_uverbs and \
         the NIC's RDMA driver (mlx5_ib, irdma, or rdma_rxe for soft-RoCE) or ask for transport tcp"
    )
}

fn no_device_message() -> String {
    "no RDMA device on this host (libibverbs lists none, /sys/class/infiniband is empty): load the NIC's RDMA driver \
     (mlx5_ib, irdma, or rdma_rxe for soft-RoCE) or ask for transport tcp"
        .to_string()
}

/// # Safety
/// `dev` is a device from a live `ibv_get_device_list` list.
unsafe fn device_name(dev: *mut ibv_device) -> String {
    // SAFETY: the caller's; libibverbs returns a NUL-terminated name owned by the device.
    let name = unsafe { ibv_get_device_name(dev) };
    if name.is_null() {
        return "unnamed device".into();
    }
    // SAFETY: non-null and NUL-terminated, alive while the list is.
    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

pub(super) fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// What backs a registered region, freed after the region is deregistered.
pub(super) enum Backing {
    /// A read-only shared mapping of the file (the holder's side).
    Map { addr: *mut c_void, len: usize },
    /// A heap buffer (the reader's side), owned here and never resized while registered.
    Heap { _owned: Vec<u8> },
}

struct Registered {
    mr: *mut ibv_mr,
    backing: Backing,
}

/// One device's verbs resources: context, protection domain, completion queue, RC queue pair
/// and the regions registered in the domain. Dropping destroys the QP first (no READ runs on
/// after it), then deregisters and frees the regions, then the CQ, PD and context.
pub(super) struct Verbs {
    pub(super) device: String,
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    gid_index: u8,
    /// The device's limits on READs in flight, as responder and as initiator.
    max_rd_atom: u8,
    max_init_rd_atom: u8,
    pub(super) local: Endpoint,
    regions: Vec<Registered>,
}

// SAFETY: libibverbs objects may be used from any thread (its verbs are thread-safe); a `Verbs`
// is owned by one task or blocking thread at a time and the raw pointers are never shared.
unsafe impl Send for Verbs {}

impl Drop for Verbs {
    fn drop(&mut self) {
        // SAFETY: every pointer was returned by the matching create call on this context and is
        // destroyed once, children before parents; null ones were never created. The QP goes
        // first so no READ touches a region after it is deregistered or freed.
        unsafe {
            if !self.qp.is_null() {
                ibv_destroy_qp(self.qp);
            }
            for r in self.regions.drain(..) {
                ibv_dereg_mr(r.mr);
                if let Backing::Map { addr, len } = r.backing {
                    libc::munmap(addr, len);
                }
            }
            if !self.cq.is_null() {
                ibv_destroy_cq(self.cq);
            }
            if !self.pd.is_null() {
                ibv_dealloc_pd(self.pd);
            }
            if !self.ctx.is_null() {
                ibv_close_device(self.ctx);
            }
        }
    }
}

impl Verbs {
    fn err(&self, message: String) -> AgentError {
        AgentError::Rdma { device: self.device.clone(), message }
    }

    /// Opens the first RDMA device (or `MOTLEY_RDMA_DEVICE`), checks port 1 is active, and makes
    /// a PD, a CQ and an RC QP in RESET, its endpoint filled in from the port's attributes.
    pub(super) fn open() -> Result<Verbs, AgentError> {
        let wanted = std::env::var("MOTLEY_RDMA_DEVICE").ok().filter(|s| !s.is_empty());
        let none = |message: String| AgentError::Rdma { device: NO_DEVICE.into(), message };
        let mut n = 0;
        // SAFETY: as in `available`: the list is walked within its `n` entries, each device
        // opened before the list is freed (a context outlives the list, per ibv_open_device(3)).
        let (device, ctx) = unsafe {
            let list = ibv_get_device_list(&mut n);
            if list.is_null() {
                return Err(none(list_error(errno())));
            }
            let devices: Vec<*mut ibv_device> = (0..n.max(0) as usize).map(|i| *list.add(i)).collect();
            let names: Vec<String> = devices.iter().map(|&d| device_name(d)).collect();
            let pick = match &wanted {
                Some(w) => names.iter().position(|name| name == w),
                None => (!devices.is_empty()).then_some(0),
            };
            let Some(i) = pick else {
                ibv_free_device_list(list);
                return Err(none(match wanted {
                    Some(w) => format!("MOTLEY_RDMA_DEVICE={w} is not among this host's RDMA devices {names:?}: name one of them"),
                    None => no_device_message(),
                }));
            };
            let ctx = ibv_open_device(devices[i]);
            let open_err = errno();
            ibv_free_device_list(list);
            if ctx.is_null() {
                return Err(AgentError::Rdma {
                    device: names[i].clone(),
                    message: format!(
                        "cannot open the device ({open_err}): check /dev/infiniband/uverbs* permissions and the memlock limit"
                    ),
                });
            }
            (names[i].clone(), ctx)
        };
        let mut v = Verbs {
            device,
            ctx,
            pd: ptr::null_mut(),
            cq: ptr::null_mut(),
            qp: ptr::null_mut(),
            gid_index: 0,
            max_rd_atom: 1,
            max_init_rd_atom: 1,
            local: Endpoint { device: String::new(), qpn: 0, lid: 0, gid: [0; 16], psn: 0, mtu: 1, roce: false },
            regions: Vec::new(),
        };
        v.local.device = v.device.clone();
        // SAFETY: `ctx` is an open context; the attribute structs are plain C data for which all
        // zeroes is a valid value, filled in by the queries; every object created is stored in
        // `v` at once so `Drop` frees it on any later error.
        unsafe {
            let mut dev_attr: ibv_device_attr = std::mem::zeroed();
            if ibv_query_device(v.ctx, &mut dev_attr) != 0 {
                return Err(v.err(format!("ibv_query_device failed ({})", errno())));
            }
            v.max_rd_atom = dev_attr.max_qp_rd_atom.clamp(1, 16) as u8;
            v.max_init_rd_atom = dev_attr.max_qp_init_rd_atom.clamp(1, 16) as u8;
            let mut port: ibv_port_attr = std::mem::zeroed();
            if ___ibv_query_port(v.ctx, PORT, &mut port) != 0 {
                return Err(v.err(format!("cannot query port {PORT} ({})", errno())));
            }
            if port.state != ibv_port_state::IBV_PORT_ACTIVE {
                return Err(v.err(format!(
                    "port {PORT} is not active (state {}): check the cable, the subnet manager (InfiniBand) or the link (RoCE) with ibv_devinfo",
                    port.state
                )));
            }
            v.local.roce = port.link_layer == LINK_LAYER_ETHERNET;
            v.local.lid = port.lid;
            v.local.mtu = port.active_mtu;
            v.gid_index = v.pick_gid_index(port.gid_tbl_len)?;
            let mut gid: ibv_gid = std::mem::zeroed();
            if ibv_query_gid(v.ctx, PORT, c_int_from(v.gid_index), &mut gid) == 0 {
                v.local.gid = gid.raw;
            } else if v.local.roce {
                return Err(v.err(format!("cannot read GID index {} of port {PORT} ({})", v.gid_index, errno())));
            }
            if v.local.roce && v.local.gid == [0; 16] {
                return Err(v.err(format!(
                    "RoCE port {PORT} has no GID at index {}: give the interface an IP address, or set MOTLEY_RDMA_GID_INDEX",
                    v.gid_index
                )));
            }
            if !v.local.roce && v.local.lid == 0 {
                return Err(v.err(format!("InfiniBand port {PORT} has no LID: is a subnet manager (opensm) running?")));
            }
            v.pd = ibv_alloc_pd(v.ctx);
            if v.pd.is_null() {
                return Err(v.err(format!("cannot allocate a protection domain ({})", errno())));
            }
            v.cq = ibv_create_cq(v.ctx, (2 * DEPTH) as i32, ptr::null_mut(), ptr::null_mut(), 0);
            if v.cq.is_null() {
                return Err(v.err(format!("cannot create a completion queue ({})", errno())));
            }
            let mut init: ibv_qp_init_attr = std::mem::zeroed();
            init.send_cq = v.cq;
            init.recv_cq = v.cq;
            init.cap.max_send_wr = DEPTH as u32;
            init.cap.max_recv_wr = 1;
            init.cap.max_send_sge = 1;
            init.cap.max_recv_sge = 1;
            init.qp_type = ibv_qp_type::IBV_QPT_RC;
            init.sq_sig_all = 1;
            v.qp = ibv_create_qp(v.pd, &mut init);
            if v.qp.is_null() {
                return Err(v.err(format!("cannot create an RC queue pair ({})", errno())));
            }
            v.local.qpn = (*v.qp).qp_num;
        }
        v.local.psn = random_psn();
        Ok(v)
    }

    /// `MOTLEY_RDMA_GID_INDEX`, else on RoCE [`choose_gid_index`] over the port's GID table
    /// (types from sysfs), else (InfiniBand) 0.
    fn pick_gid_index(&self, table_len: i32) -> Result<u8, AgentError> {
        if let Ok(s) = std::env::var("MOTLEY_RDMA_GID_INDEX") {
            return s.trim().parse().map_err(|_| self.err(format!("MOTLEY_RDMA_GID_INDEX={s} is not a GID index (0..=255)")));
        }
        if !self.local.roce {
            return Ok(0);
        }
        let mut table = Vec::new();
        for i in 0..table_len.clamp(0, 256) as u8 as usize {
            let i = i as u8;
            let types = format!("/sys/class/infiniband/{}/ports/{PORT}/gid_attrs/types/{i}", self.device);
            // SAFETY: `ctx` is open; `gid` is plain data filled in by the query.
            let gid = unsafe {
                let mut gid: ibv_gid = std::mem::zeroed();
                if ibv_query_gid(self.ctx, PORT, c_int_from(i), &mut gid) != 0 {
                    continue;
                }
                gid.raw
            };
            table.push((i, std::fs::read_to_string(types).ok(), gid));
        }
        choose_gid_index(&table).ok_or_else(|| {
            self.err(format!("RoCE port {PORT} has no GID set: give the interface an IP address (or set MOTLEY_RDMA_GID_INDEX)"))
        })
    }

    /// Registers `len` bytes at `addr` with `access`, keeping `backing` until deregistered.
    ///
    /// # Safety
    /// `addr..addr + len` is memory owned by `backing` that stays put while registered.
    pub(super) unsafe fn register(
        &mut self,
        addr: *mut c_void,
        len: usize,
        access: u32,
        backing: Backing,
    ) -> Result<(u64, u32, u32), AgentError> {
        // SAFETY: the caller's; `pd` is a live protection domain.
        let mr = unsafe { ibv_reg_mr(self.pd, addr, len, access as i32) };
        if mr.is_null() {
            let e = errno();
            if let Backing::Map { addr, len } = backing {
                // SAFETY: the mapping is ours and no region refers to it.
                unsafe { libc::munmap(addr, len) };
            }
            return Err(self.err(format!(
                "cannot register {len} bytes as a memory region ({e}): raise the memlock limit (ulimit -l unlimited, LimitMEMLOCK=infinity)"
            )));
        }
        // SAFETY: `mr` is a live region returned just above.
        let (a, l, r) = unsafe { ((*mr).addr as u64, (*mr).lkey, (*mr).rkey) };
        self.regions.push(Registered { mr, backing });
        Ok((a, l, r))
    }

    /// RESET -> INIT -> RTR -> RTS against `remote`, with the port attributes queried at open.
    pub(super) fn connect(&self, remote: &Endpoint) -> Result<(), AgentError> {
        if remote.roce != self.local.roce {
            let kind = |roce| if roce { "RoCE" } else { "InfiniBand" };
            return Err(self.err(format!(
                "this side is {} and the peer ({}) is {}: they share no RDMA domain; use transport tcp",
                kind(self.local.roce),
                remote.device,
                kind(remote.roce)
            )));
        }
        // SAFETY: `qp` is a live RC QP; `attr` is plain C data (all zeroes valid) with exactly
        // the fields named in each mask set.
        unsafe {
            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
            attr.pkey_index = 0;
            attr.port_num = PORT;
            attr.qp_access_flags = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
            self.modify(&mut attr, mask, "INIT")?;

            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
            attr.path_mtu = self.local.mtu.min(remote.mtu);
            attr.dest_qp_num = remote.qpn;
            attr.rq_psn = remote.psn;
            attr.max_dest_rd_atomic = self.max_rd_atom;
            attr.min_rnr_timer = 12;
            attr.ah_attr.port_num = PORT;
            attr.ah_attr.sl = 0;
            attr.ah_attr.src_path_bits = 0;
            attr.ah_attr.dlid = remote.lid;
            if self.local.roce {
                // RoCE routes by GID: a global route header to the peer's GID from ours.
                attr.ah_attr.is_global = 1;
                attr.ah_attr.grh.dgid.raw = remote.gid;
                attr.ah_attr.grh.sgid_index = self.gid_index;
                attr.ah_attr.grh.hop_limit = 64;
                attr.ah_attr.grh.traffic_class = 0;
                attr.ah_attr.grh.flow_label = 0;
            }
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            self.modify(&mut attr, mask, "RTR")?;

            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
            attr.timeout = 14;
            attr.retry_cnt = 7;
            attr.rnr_retry = 7;
            attr.sq_psn = self.local.psn;
            attr.max_rd_atomic = self.max_init_rd_atom;
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            self.modify(&mut attr, mask, "RTS")?;
        }
        Ok(())
    }

    /// # Safety
    /// `attr` has the fields in `mask` set for this transition.
    unsafe fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, state: &str) -> Result<(), AgentError> {
        // SAFETY: the caller's; `qp` is live.
        let rc = unsafe { ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            return Err(self.err(format!(
                "cannot move the queue pair to {state} ({}): check both ports with ibv_devinfo (RoCE: GID index {}, MOTLEY_RDMA_GID_INDEX)",
                std::io::Error::from_raw_os_error(rc),
                self.gid_index
            )));
        }
        Ok(())
    }

    /// Posts READs of `pieces` from `region` into `DEPTH` slots of a registered buffer, writing
    /// each completed piece at its offset into `dest`; blocking (run it in `spawn_blocking`).
    pub(super) fn read_all(&mut self, region: &Region, pieces: &[(u64, u32)], dest: &File) -> Result<u64, AgentError> {
        let slots = DEPTH.min(pieces.len()).max(1);
        let mut buf = vec![0u8; slots * PIECE as usize];
        let base = buf.as_mut_ptr();
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        // SAFETY: `buf` moves into the region's backing (the heap allocation stays put) and is
        // freed only after the QP is destroyed and the region deregistered.
        let (_, lkey, _) = unsafe { self.register(base.cast(), buf.len(), access, Backing::Heap { _owned: buf })? };
        let mut free: Vec<usize> = (0..slots).rev().collect();
        let (mut next, mut done, mut bytes) = (0usize, 0usize, 0u64);
        let mut wcs: Vec<ibv_wc> = Vec::with_capacity(DEPTH);
        let mut last = Instant::now();
        let mut idle = 0u32;
        while done < pieces.len() {
            while next < pieces.len() {
                let Some(slot) = free.pop() else { break };
                let (offset, len) = pieces[next];
                // SAFETY: the slot lies inside the registered buffer (slot < slots, len <= PIECE);
                // the remote address lies inside the holder's region (checked by decode_control
                // and `fetch`); `wr` and `sge` outlive the call, which copies them.
                unsafe {
                    let mut sge = ibv_sge { addr: base.add(slot * PIECE as usize) as u64, length: len, lkey };
                    let mut wr: ibv_send_wr = std::mem::zeroed();
                    wr.wr_id = ((next as u64) << 8) | slot as u64;
                    wr.sg_list = &mut sge;
                    wr.num_sge = 1;
                    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
                    wr.wr.rdma.remote_addr = region.addr + (offset - region.offset);
                    wr.wr.rdma.rkey = region.rkey;
                    let mut bad: *mut ibv_send_wr = ptr::null_mut();
                    let rc = ibv_post_send(self.qp, &mut wr, &mut bad);
                    if rc != 0 {
                        return Err(self.err(format!(
                            "cannot post an RDMA READ of {len} bytes at file offset {offset} ({})",
                            std::io::Error::from_raw_os_error(rc)
                        )));
                    }
                }
                next += 1;
            }
            // SAFETY: `wcs` has room for DEPTH entries; poll_cq fills the first `got` of them.
            let got = unsafe {
                let got = ibv_poll_cq(self.cq, DEPTH as i32, wcs.as_mut_ptr());
                if got < 0 {
                    return Err(self.err("polling the completion queue failed".into()));
                }
                wcs.set_len(got as usize);
                got
            };
            if got == 0 {
                if last.elapsed() > COMPLETION_TIMEOUT {
                    return Err(self.err(format!(
                        "no RDMA READ completed in {}s ({done} of {} pieces done): check the path between the two ports",
                        COMPLETION_TIMEOUT.as_secs(),
                        pieces.len()
                    )));
                }
                // Spin briefly (a 1 MiB READ takes ~80 us at 100 Gb/s), then sleep a little.
                idle += 1;
                if idle > 1000 {
                    std::thread::sleep(Duration::from_micros(20));
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            idle = 0;
            last = Instant::now();
            for wc in wcs.drain(..) {
                let (index, slot) = ((wc.wr_id >> 8) as usize, (wc.wr_id & 0xff) as usize);
                let (offset, len) = pieces[index];
                if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                    // SAFETY: ibv_wc_status_str returns a static NUL-terminated string.
                    let why = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }.to_string_lossy();
                    return Err(self.err(format!(
                        "RDMA READ of {len} bytes at file offset {offset} failed: {why} (status {}){}",
                        wc.status,
                        if wc.status == ibv_wc_status::IBV_WC_REM_ACCESS_ERR { ": the holder's rkey does not cover it" } else { "" }
                    )));
                }
                // SAFETY: the READ into this slot completed, so its `len` bytes are written and
                // nothing else writes them until the slot is reposted below.
                let data = unsafe { std::slice::from_raw_parts(base.add(slot * PIECE as usize), len as usize) };
                dest.write_all_at(data, offset).map_err(|e| self.err(format!("cannot write {len} bytes at offset {offset}: {e}")))?;
                bytes += u64::from(len);
                done += 1;
                free.push(slot);
            }
        }
        Ok(bytes)
    }
}

fn c_int_from(i: u8) -> i32 {
    i32::from(i)
}

fn random_psn() -> u32 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    (nanos ^ std::process::id().rotate_left(12)) & 0xff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_gid_choice_prefers_a_set_roce_v2_gid() {
        let v4 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];
        let link = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        let t = |s: &str| Some(format!("{s}\n"));
        assert_eq!(choose_gid_index(&[]), None);
        assert_eq!(choose_gid_index(&[(0, t("IB/RoCE v1"), [0; 16])]), None);
        let table = [(0, t("IB/RoCE v1"), link), (1, t("RoCE v2"), link), (2, t("IB/RoCE v1"), v4), (3, t("RoCE v2"), v4)];
        assert_eq!(choose_gid_index(&table), Some(1));
        assert_eq!(choose_gid_index(&[(0, t("RoCE v2"), [0; 16]), (1, t("IB/RoCE v1"), v4)]), Some(1));
        assert_eq!(choose_gid_index(&[(4, None, v4)]), Some(4));
    }

    /// Whether this host has an RDMA device, per sysfs (independent of libibverbs).
    fn host_has_device() -> bool {
        std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
    }

    #[test]
    fn rdma_available_names_why_there_is_no_device() {
        match available() {
            Ok(dev) => assert!(host_has_device(), "libibverbs lists {dev} but sysfs has no device"),
            Err(why) => {
                assert!(!host_has_device(), "sysfs lists a device yet: {why}");
                assert!(why.contains("no RDMA device on this host"), "{why}");
                assert!(why.contains("transport tcp"), "names the fix: {why}");
            }
        }
    }
}
