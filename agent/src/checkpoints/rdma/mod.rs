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
//!
//! `control` holds the messages and their checks, `verbs` the device (queue pair, memory
//! regions, the READs themselves), `transfer` the two sides of one transfer driving both.

mod control;
mod transfer;
mod verbs;

pub use control::{decode_control, encode_control, split_reads, Control, Endpoint, Region};
pub use transfer::{fetch, serve};
pub use verbs::{available, choose_gid_index};

/// The largest RDMA READ work request: ranges are read in pieces of at most this many bytes.
pub const PIECE: u64 = 1 << 20;
/// READs in flight at once (and local buffer slots of [`PIECE`] bytes each).
pub const DEPTH: usize = 16;
/// The largest control message: an offer lists the ranges, and `dataplane` caps their count.
pub const CONTROL_MAX: u32 = 4 << 20;
