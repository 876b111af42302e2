//! The checkpoint data plane's RDMA path (cargo feature `rdma`): one-sided RDMA READs over an
//! RC queue pair, through the system libibverbs (bindings: `rdma-sys`).
//!
//! `dataplane` answers a request whose JSON header asked for transport `rdma` by handing its TCP
//! stream to [`serve`] (the holder) and [`fetch`] (the reader). Over that stream the two sides
//! then exchange length-prefixed JSON control messages ([`encode_control`] and
//! [`decode_control`]):
//!
//! 1. holder -> reader: [`Control::Offer`]: its QP (number, LID, GID, PSN, MTU, link layer), the
//!    memory region over the file's requested span (address, length, rkey, the file offset it
//!    starts at) and the ranges;
//! 2. reader -> holder: [`Control::Accept`]: its own QP;
//! 3. holder -> reader: [`Control::Ready`] once its QP is at RTR/RTS (it can answer READs);
//! 4. reader: READs of every range, at most [`PIECE`] bytes each, into a registered buffer, each
//!    piece written at its offset into the destination file; then [`Control::Done`];
//! 5. holder: deregisters the region and unmaps the file.
//!
//! Either side that cannot go on sends [`Control::Error`] in place of its next message and
//! returns the error, so neither waits on the other for nothing; every wait has a time limit.
//! A range is `(offset, length)` in bytes, as in `dataplane`.

use std::ffi::{c_void, CStr};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::ptr;
use std::time::{Duration, Instant};

use rdma_sys::*;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::AgentError;

/// The largest RDMA READ work request: ranges are read in pieces of at most this many bytes.
pub const PIECE: u64 = 1 << 20;
/// READs in flight at once (and local buffer slots of [`PIECE`] bytes each).
pub const DEPTH: usize = 16;
/// The largest control message: an offer lists the ranges, and `dataplane` caps their count.
pub const CONTROL_MAX: u32 = 4 << 20;
/// How long a side waits for each handshake message.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the reader waits for the next READ completion before it gives up.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(30);
/// The port both sides use (verbs ports are numbered from 1).
const PORT: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that the bindings leave out).
const LINK_LAYER_ETHERNET: u8 = 2;
/// Where the device is named when there is none.
const NO_DEVICE: &str = "no device";

/// One side's queue pair, as the other needs it to address it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// The RDMA device's name (for error messages on the other side).
    pub device: String,
    /// The QP number (24 bits).
    pub qpn: u32,
    /// The port's LID (InfiniBand addressing).
    pub lid: u16,
    /// The GID at `gid_index` (RoCE addressing; all zero when there is none).
    pub gid: [u8; 16],
    /// The first packet sequence number (24 bits).
    pub psn: u32,
    /// The port's active MTU as an `ibv_mtu` value (1 = 256 bytes ... 5 = 4096).
    pub mtu: u32,
    /// The port's link layer is Ethernet (RoCE: route by GID) rather than InfiniBand (by LID).
    pub roce: bool,
}

/// The holder's memory region over the file's bytes `[offset, offset + len)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// The region's virtual address on the holder (the READs' remote address at `offset`).
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The key that lets the peer READ it (and nothing else).
    pub rkey: u32,
    /// The file offset its first byte holds.
    pub offset: u64,
}

/// The control messages of the RDMA path, sent over the data plane's TCP stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum Control {
    /// Holder -> reader: its QP, the registered region and the ranges the reader may READ.
    Offer { endpoint: Endpoint, region: Region, ranges: Vec<(u64, u64)> },
    /// Reader -> holder: the reader's QP.
    Accept { endpoint: Endpoint },
    /// Holder -> reader: the holder's QP answers READs now. (A struct variant, so that unknown
    /// fields are refused as in the others.)
    Ready {},
    /// Reader -> holder: every range is read (this many bytes); the holder may deregister.
    Done { bytes: u64 },
    /// Either side: it cannot go on, and why.
    Error { message: String },
}

/// A control message as it goes over the stream: a 4-byte big-endian length, then JSON.
pub fn encode_control(msg: &Control) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("control messages always serialize");
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame
}

/// The message in `frame` (exactly one, as [`encode_control`] makes it), checked: the length
/// prefix matches, the JSON is a known message with no unknown field, PSNs and QP numbers fit in
/// 24 bits, the MTU is an `ibv_mtu`, and an offer's ranges are non-empty, do not overflow and lie
/// inside its region.
pub fn decode_control(frame: &[u8]) -> Result<Control, String> {
    let Some((prefix, body)) = frame.split_first_chunk::<4>() else {
        return Err(format!("control message of {} bytes is shorter than its 4-byte length prefix", frame.len()));
    };
    let len = u32::from_be_bytes(*prefix);
    if len > CONTROL_MAX {
        return Err(format!("control message claims {len} bytes, at most {CONTROL_MAX}"));
    }
    if body.len() != len as usize {
        return Err(format!("control message claims {len} bytes but has {}", body.len()));
    }
    let msg: Control = serde_json::from_slice(body).map_err(|e| format!("control message is not valid: {e}"))?;
    let check_endpoint = |e: &Endpoint| -> Result<(), String> {
        if e.qpn > 0xff_ffff || e.psn > 0xff_ffff {
            return Err(format!("QP number {} or PSN {} does not fit in 24 bits", e.qpn, e.psn));
        }
        if !(1..=5).contains(&e.mtu) {
            return Err(format!("MTU {} is not an ibv_mtu (1..=5)", e.mtu));
        }
        Ok(())
    };
    match &msg {
        Control::Offer { endpoint, region, ranges } => {
            check_endpoint(endpoint)?;
            if region.len == 0 || region.addr.checked_add(region.len).is_none() || region.offset.checked_add(region.len).is_none() {
                return Err(format!(
                    "region of {} bytes at {:#x} (file offset {}) is empty or overflows",
                    region.len, region.addr, region.offset
                ));
            }
            for &(offset, len) in ranges {
                let end = offset.checked_add(len);
                if len == 0 || offset < region.offset || end.is_none_or(|end| end > region.offset + region.len) {
                    return Err(format!(
                        "range (offset {offset}, length {len}) is empty or outside the region [{}, {})",
                        region.offset,
                        region.offset + region.len
                    ));
                }
            }
        }
        Control::Accept { endpoint } => check_endpoint(endpoint)?,
        Control::Ready {} | Control::Done { .. } | Control::Error { .. } => {}
    }
    Ok(msg)
}

/// The READ work requests for `ranges`: `(file offset, length)` pieces of at most `max` bytes
/// each, in order, covering every range exactly.
pub fn split_reads(ranges: &[(u64, u64)], max: u64) -> Vec<(u64, u32)> {
    assert!(max > 0 && max <= u64::from(u32::MAX), "a READ piece is 1..=u32::MAX bytes");
    let mut pieces = Vec::new();
    for &(offset, len) in ranges {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(max);
            pieces.push((offset + at, n as u32));
            at += n;
        }
    }
    pieces
}

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

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// What backs a registered region, freed after the region is deregistered.
enum Backing {
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
struct Verbs {
    device: String,
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    gid_index: u8,
    /// The device's limits on READs in flight, as responder and as initiator.
    max_rd_atom: u8,
    max_init_rd_atom: u8,
    local: Endpoint,
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
    fn open() -> Result<Verbs, AgentError> {
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
    unsafe fn register(&mut self, addr: *mut c_void, len: usize, access: u32, backing: Backing) -> Result<(u64, u32, u32), AgentError> {
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
    fn connect(&self, remote: &Endpoint) -> Result<(), AgentError> {
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
    fn read_all(&mut self, region: &Region, pieces: &[(u64, u32)], dest: &File) -> Result<u64, AgentError> {
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

async fn send(stream: &mut TcpStream, msg: &Control) -> std::io::Result<()> {
    stream.write_all(&encode_control(msg)).await?;
    stream.flush().await
}

/// The peer's next control message, within `limit`.
async fn recv(stream: &mut TcpStream, limit: Duration) -> Result<Control, String> {
    let read = async {
        let mut frame = vec![0u8; 4];
        stream.read_exact(&mut frame).await.map_err(|e| format!("the peer closed the stream ({e})"))?;
        let len = u32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]);
        if len > CONTROL_MAX {
            return Err(format!("control message claims {len} bytes, at most {CONTROL_MAX}"));
        }
        frame.resize(4 + len as usize, 0);
        stream.read_exact(&mut frame[4..]).await.map_err(|e| format!("the peer closed the stream ({e})"))?;
        decode_control(&frame)
    };
    tokio::time::timeout(limit, read).await.map_err(|_| format!("the peer sent nothing for {}s", limit.as_secs()))?
}

/// Tells the peer why this side stops (best effort: it may be gone) and returns the error.
async fn abort<T>(stream: &mut TcpStream, err: AgentError) -> Result<T, AgentError> {
    let _ = send(stream, &Control::Error { message: err.to_string() }).await;
    Err(err)
}

/// How long the holder waits for "done": the handshake limit plus the transfer at 50 MB/s.
fn done_timeout(bytes: u64) -> Duration {
    HANDSHAKE_TIMEOUT + Duration::from_secs(bytes / 50_000_000)
}

fn peer_err(device: &str, what: &str, why: String) -> AgentError {
    AgentError::Rdma { device: device.into(), message: format!("{what}: {why}") }
}

/// Holder side. `stream` is the TCP connection of a data-plane request whose JSON header asked
/// for transport rdma; the header exchange is done. Register the file's bytes (mmap of `path`,
/// read-only) as a memory region, send the peer over `stream` what it needs for one-sided READs
/// (QP number, LID/GID, PSN, the MR's address, length and rkey, and the ranges), wait for the
/// peer's "done" message, deregister. Errors name the device, the file and the fix.
pub async fn serve(stream: &mut TcpStream, path: &Path, ranges: &[(u64, u64)]) -> Result<(), AgentError> {
    if ranges.is_empty() {
        return Ok(()); // nothing to read; `fetch` returns at once too
    }
    let file_err = |device: &str, message: String| AgentError::Rdma {
        device: device.into(),
        message: format!("serving {}: {message}", path.display()),
    };
    // The device's errors, with the file named.
    let in_file = |e: AgentError| match e {
        AgentError::Rdma { device, message } => file_err(&device, message),
        other => other,
    };
    let mut verbs = match Verbs::open() {
        Ok(v) => v,
        Err(e) => return abort(stream, in_file(e)).await,
    };
    let device = verbs.device.clone();
    // The span of the ranges, page-aligned at its start for mmap: the region covers only it.
    let start = ranges.iter().map(|r| r.0).min().unwrap_or(0);
    let end = ranges.iter().map(|r| r.0.saturating_add(r.1)).max().unwrap_or(0);
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) => return abort(stream, file_err(&device, format!("cannot open the file ({e})"))).await,
    };
    let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if end > file_len {
        let message = format!("ranges reach byte {end} but the file has {file_len}: ask for ranges inside it");
        return abort(stream, file_err(&device, message)).await;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let map_off = start / page * page;
    let map_len = (end - map_off) as usize;
    // SAFETY: a fresh read-only shared mapping of an open file within its length; it is owned by
    // the region's backing and unmapped after deregistration (or at once if that fails).
    let addr = unsafe { libc::mmap(ptr::null_mut(), map_len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), map_off as i64) };
    if addr == libc::MAP_FAILED {
        return abort(stream, file_err(&device, format!("cannot map {map_len} bytes of the file ({})", errno()))).await;
    }
    // Remote READ only: no local write access, so the read-only mapping can be pinned.
    let access = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    // SAFETY: the mapping is `map_len` bytes and stays until the region is deregistered.
    let registered = unsafe { verbs.register(addr, map_len, access, Backing::Map { addr, len: map_len }) };
    let (mr_addr, _, rkey) = match registered {
        Ok(r) => r,
        Err(e) => return abort(stream, in_file(e)).await,
    };
    let region = Region { addr: mr_addr, len: map_len as u64, rkey, offset: map_off };
    let offer = Control::Offer { endpoint: verbs.local.clone(), region, ranges: ranges.to_vec() };
    send(stream, &offer).await.map_err(|e| file_err(&device, format!("cannot send the offer to the reader ({e})")))?;
    let remote = match recv(stream, HANDSHAKE_TIMEOUT).await {
        Ok(Control::Accept { endpoint }) => endpoint,
        Ok(Control::Error { message }) => return Err(file_err(&device, format!("the reader cannot READ over RDMA: {message}"))),
        Ok(other) => return abort(stream, file_err(&device, format!("the reader sent {other:?} instead of its queue pair"))).await,
        Err(why) => return Err(file_err(&device, format!("waiting for the reader's queue pair: {why}"))),
    };
    if let Err(e) = verbs.connect(&remote) {
        return abort(stream, in_file(e)).await;
    }
    send(stream, &Control::Ready {}).await.map_err(|e| file_err(&device, format!("cannot tell the reader to start ({e})")))?;
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let result = match recv(stream, done_timeout(total)).await {
        Ok(Control::Done { .. }) => Ok(()),
        Ok(Control::Error { message }) => Err(file_err(&device, format!("the reader stopped: {message}"))),
        Ok(other) => Err(file_err(&device, format!("the reader sent {other:?} instead of done"))),
        Err(why) => Err(file_err(&device, format!("waiting for the reader's done: {why}"))),
    };
    // Destroy the QP, deregister and unmap off the async threads.
    let _ = tokio::task::spawn_blocking(move || drop(verbs)).await;
    result
}

/// Reader side: exchange QP info over `stream`, post RDMA READs of `ranges` (in pieces of at
/// most 1 MiB) into a registered local buffer, write each piece at its offset into `dest`
/// (positional writes), send "done"; returns bytes read. The caller verifies the manifest crc32c
/// of the whole file afterwards.
pub async fn fetch(stream: &mut TcpStream, ranges: &[(u64, u64)], dest: &File) -> Result<u64, AgentError> {
    if ranges.is_empty() {
        return Ok(0); // `serve` sends nothing for no ranges
    }
    let mut verbs = match Verbs::open() {
        Ok(v) => v,
        Err(e) => return abort(stream, e).await,
    };
    let device = verbs.device.clone();
    let (holder, region, offered) = match recv(stream, HANDSHAKE_TIMEOUT).await {
        Ok(Control::Offer { endpoint, region, ranges }) => (endpoint, region, ranges),
        Ok(Control::Error { message }) => return Err(peer_err(&device, "the holder cannot serve over RDMA", message)),
        Ok(other) => return abort(stream, peer_err(&device, "the holder's first message", format!("{other:?} instead of an offer"))).await,
        Err(why) => return Err(peer_err(&device, "waiting for the holder's offer", why)),
    };
    // Every requested byte must be inside a range the holder offered (its region's rkey allows
    // nothing else; checking here names the range instead of a remote access error).
    let outside = ranges.iter().find(|&&(o, l)| !offered.iter().any(|&(oo, ol)| o >= oo && o.saturating_add(l) <= oo.saturating_add(ol)));
    if let Some((o, l)) = outside {
        let why = format!("range (offset {o}, length {l}) is not among the offered ranges {offered:?}");
        return abort(stream, peer_err(&device, "the holder's offer", why)).await;
    }
    if let Err(e) = send(stream, &Control::Accept { endpoint: verbs.local.clone() }).await {
        return Err(peer_err(&device, "cannot send the queue pair to the holder", e.to_string()));
    }
    if let Err(e) = verbs.connect(&holder) {
        return abort(stream, e).await;
    }
    match recv(stream, HANDSHAKE_TIMEOUT).await {
        Ok(Control::Ready {}) => {}
        Ok(Control::Error { message }) => return Err(peer_err(&device, format!("the holder ({})", holder.device).as_str(), message)),
        Ok(other) => return abort(stream, peer_err(&device, "the holder", format!("sent {other:?} instead of ready"))).await,
        Err(why) => return Err(peer_err(&device, "waiting for the holder to be ready", why)),
    }
    let pieces = split_reads(ranges, PIECE);
    let dest = match dest.try_clone() {
        Ok(f) => f,
        Err(e) => return abort(stream, peer_err(&device, "cannot duplicate the destination file", e.to_string())).await,
    };
    let read = tokio::task::spawn_blocking(move || {
        let r = verbs.read_all(&region, &pieces, &dest);
        drop(verbs);
        r
    })
    .await
    .unwrap_or_else(|e| Err(peer_err(&device, "the READ thread failed", e.to_string())));
    match read {
        Ok(bytes) => {
            send(stream, &Control::Done { bytes })
                .await
                .map_err(|e| peer_err(&device, "cannot tell the holder the READs are done", e.to_string()))?;
            Ok(bytes)
        }
        Err(e) => abort(stream, e).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint() -> Endpoint {
        Endpoint { device: "mlx5_0".into(), qpn: 0x1234, lid: 7, gid: [0xfe; 16], psn: 0xabcdef, mtu: 5, roce: true }
    }

    fn offer() -> Control {
        Control::Offer {
            endpoint: endpoint(),
            region: Region { addr: 0x7f00_0000_0000, len: 8 << 20, rkey: 0xdead, offset: 4096 },
            ranges: vec![(4096, 100), (1 << 20, 3 << 20)],
        }
    }

    fn frame(body: &str) -> Vec<u8> {
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(body.as_bytes());
        f
    }

    #[test]
    fn rdma_control_messages_round_trip() {
        for msg in [
            offer(),
            Control::Accept { endpoint: Endpoint { roce: false, gid: [0; 16], ..endpoint() } },
            Control::Ready {},
            Control::Done { bytes: u64::MAX },
            Control::Error { message: "no RDMA device \"x\"\n".into() },
        ] {
            let f = encode_control(&msg);
            assert_eq!(u32::from_be_bytes(f[..4].try_into().unwrap()) as usize, f.len() - 4);
            assert_eq!(decode_control(&f).unwrap(), msg);
        }
    }

    #[test]
    fn rdma_control_messages_reject_malformed_input() {
        let good = encode_control(&offer());
        let bad: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "shorter than"),
            (vec![0, 0, 1], "shorter than"),
            (good[..good.len() - 1].to_vec(), "claims"),
            ([good.clone(), vec![b' ']].concat(), "claims"),
            ((CONTROL_MAX + 1).to_be_bytes().to_vec(), "at most"),
            (frame("not json"), "not valid"),
            (frame(r#"{"msg":"launch"}"#), "not valid"),
            (frame(r#"{"msg":"done"}"#), "not valid"),
            (frame(r#"{"msg":"done","bytes":-1}"#), "not valid"),
            (frame(r#"{"msg":"ready","extra":1}"#), "not valid"),
            (frame(r#"{"bytes":1}"#), "not valid"),
        ];
        for (f, why) in bad {
            let err = decode_control(&f).unwrap_err();
            assert!(err.contains(why), "{f:?}: {err}");
        }
        type Edit<'a> = &'a dyn Fn(&mut Endpoint, &mut Region, &mut Vec<(u64, u64)>);
        let with = |edit: Edit| {
            let Control::Offer { mut endpoint, mut region, mut ranges } = offer() else { unreachable!() };
            edit(&mut endpoint, &mut region, &mut ranges);
            decode_control(&encode_control(&Control::Offer { endpoint, region, ranges })).unwrap_err()
        };
        assert!(with(&|e, _, _| e.psn = 1 << 24).contains("24 bits"));
        assert!(with(&|e, _, _| e.qpn = u32::MAX).contains("24 bits"));
        assert!(with(&|e, _, _| e.mtu = 0).contains("ibv_mtu"));
        assert!(with(&|e, _, _| e.mtu = 6).contains("ibv_mtu"));
        assert!(with(&|_, r, _| r.len = 0).contains("empty or overflows"));
        assert!(with(&|_, r, _| r.addr = u64::MAX).contains("empty or overflows"));
        assert!(with(&|_, _, g| g.push((0, 10))).contains("outside the region"));
        assert!(with(&|_, _, g| g.push((8 << 20, 4097))).contains("outside the region"));
        assert!(with(&|_, _, g| g.push((5000, 0))).contains("empty"));
        assert!(with(&|_, _, g| g.push((u64::MAX, 2))).contains("outside the region"));
        let accept = Control::Accept { endpoint: Endpoint { psn: 1 << 24, ..endpoint() } };
        assert!(decode_control(&encode_control(&accept)).unwrap_err().contains("24 bits"));
    }

    #[test]
    fn rdma_split_reads_covers_ranges_in_pieces_of_at_most_a_mib() {
        assert!(split_reads(&[], PIECE).is_empty());
        assert_eq!(split_reads(&[(5, 1)], PIECE), vec![(5, 1)]);
        assert_eq!(split_reads(&[(0, PIECE)], PIECE), vec![(0, PIECE as u32)]);
        assert_eq!(split_reads(&[(0, PIECE + 1)], PIECE), vec![(0, PIECE as u32), (PIECE, 1)]);
        // Property-ish: many pseudo-random range lists (an LCG, so the run is reproducible).
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..300 {
            let max = [1, 7, 4096, PIECE][rand(4) as usize];
            let mut ranges = Vec::new();
            let mut at = rand(1 << 30);
            for _ in 0..rand(6) {
                let len = 1 + rand(5 * PIECE);
                ranges.push((at, len));
                at += len + rand(3 * PIECE);
            }
            if max == 1 && ranges.iter().map(|r| r.1).sum::<u64>() > 2_000_000 {
                ranges.truncate(1);
                ranges.iter_mut().for_each(|r| r.1 = r.1.min(1000));
            }
            let pieces = split_reads(&ranges, max);
            let want: u64 = ranges.iter().map(|r| r.1.div_ceil(max)).sum();
            assert_eq!(pieces.len() as u64, want, "{ranges:?} by {max}");
            let mut it = pieces.iter().peekable();
            for &(offset, len) in &ranges {
                let mut covered = offset;
                while covered < offset + len {
                    let &(o, l) = it.next().expect("a piece for every byte");
                    assert_eq!(o, covered, "pieces are contiguous and in order");
                    assert!(l > 0 && u64::from(l) <= max, "piece of {l} bytes, max {max}");
                    covered += u64::from(l);
                }
                assert_eq!(covered, offset + len, "no piece crosses a range's end");
            }
            assert!(it.next().is_none());
        }
    }

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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rdma_serve_and_fetch_without_a_device_fail_cleanly() {
        if host_has_device() {
            return; // the verbs path itself is exercised on RDMA hardware only (README "RDMA")
        }
        let dir = std::env::temp_dir().join(format!("motley-rdma-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("shard.bin");
        std::fs::write(&src, vec![7u8; 3 << 20]).unwrap();
        let dest = File::create(dir.join("copy.bin")).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ranges = vec![(0u64, 1u64 << 20), (2 << 20, 1 << 20)];
        let holder = {
            let (src, ranges) = (src.clone(), ranges.clone());
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                serve(&mut s, &src, &ranges).await
            })
        };
        let mut client = TcpStream::connect(addr).await.unwrap();
        let both = async { (fetch(&mut client, &ranges, &dest).await, holder.await.unwrap()) };
        let (fetched, served) = tokio::time::timeout(Duration::from_secs(20), both).await.expect("no hang");
        let (fetch_err, serve_err) = (fetched.unwrap_err().to_string(), served.unwrap_err().to_string());
        eprintln!("fetch: {fetch_err}\nserve: {serve_err}");
        for err in [&fetch_err, &serve_err] {
            assert!(err.starts_with("RDMA (no device):"), "{err}");
            assert!(err.contains("no RDMA device on this host") && err.contains("transport tcp"), "{err}");
        }
        assert!(serve_err.contains(&src.display().to_string()), "names the file: {serve_err}");
        // Nothing was written.
        assert_eq!(dest.metadata().unwrap().len(), 0);
        // A request for no ranges needs no device on either side.
        assert_eq!(fetch(&mut client, &[], &dest).await.unwrap(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
