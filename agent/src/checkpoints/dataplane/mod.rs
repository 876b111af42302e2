//! The checkpoint data plane (docs/recovery.md, "The data plane"): agents serve the checkpoint files
//! they hold to peers and fetch the ones their new ranks need, each flow paced to its planned
//! rate, every byte checked on arrival.
//!
//! # Protocol, version 1 (a contract between agents of one Motley version)
//!
//! One TCP connection per request; over TLS (the agent's `--tls-cert`/`--tls-key`, ALPN
//! `motley-data/1`) wherever the agent has a certificate, and then only over TLS: its
//! `data_url` is `tls://HOST:PORT`, a plain-TCP client fails the handshake, and its own
//! fetches never fall back to plain TCP. A server takes at most `limits::MAX_CONNECTIONS`
//! connections at once (the rest wait, unread, in the listen queue), at most
//! `limits::MAX_PER_SOURCE` of them from one source address (one more from it is closed at
//! once), and each must bring its handshake and request line within two base intervals, 1 to
//! 10 s (`DataKey::request_deadline`), or it is closed.
//!
//! 1. The client sends one JSON line (at most 64 KiB, newline-terminated), then nothing until
//!    the reply:
//!    `{"v":1,"capability":"...","job":J,"generation":G,"step":S,"file":"NAME","ranges":[[offset,len],...],"rate_bytes_s":R|null,"transport":"tcp"|"rdma"}`.
//!    `generation` is the launch that wrote the file; `file` its name in the step directory,
//!    spelled as docs/checkpoint.md spells it (a unit, `rank.RRRRR.safetensors`,
//!    `manifest.rank.RRRRR.json`, `manifest.json`); ranges are non-empty, do not overlap, at
//!    most 1024; `rate_bytes_s` the flow's planned rate (null: unpaced but for the server's
//!    own pacers); `capability` the file's capability for this server from its `FetchSource`
//!    (never the agent's own token: docs/recovery.md, "Who may fetch"). The server checks it
//!    against its own node's data-plane key before anything else (and its previous key, for a
//!    while after the key changed): signed by the coordinator for this node, not expired, and
//!    for this job, generation, step and file; a server without a key (not yet registered)
//!    refuses every request.
//! 2. The server answers one JSON line: `{"ok":true,"bytes":FILE_LEN}`, or
//!    `{"ok":false,"error":"..."}` naming the file and why (not held here, a range beyond the
//!    file's length, no or a wrong capability, unknown version, no RDMA) and closes the
//!    connection.
//! 3. Over `tcp`, the server then sends, for each range in the order asked, frames
//!    `offset u64 LE | len u32 LE | crc32c u32 LE | len bytes` of at most 1 MiB each, covering
//!    the range in order, and after the last range one end frame with `len` 0 (offset and crc
//!    0). The crc is CRC-32C (Castagnoli) of the frame's bytes. Over `rdma` (cargo feature
//!    `rdma`), the connection then belongs to `checkpoints::rdma`.
//!
//! The client checks every frame's crc on arrival and that frames come in exactly that order
//! (so each requested byte arrives once); anything else ends the fetch with
//! `AgentError::DataPlane`, and the caller fetches from another holder. A file this node is
//! still fetching (`Arriving`) is served once complete: the server waits for it.
//!
//! ## Probes (`probe`; docs/network.md, "Measure (agents)")
//!
//! A request line with a `probe` field asks for bytes that measure the link instead of a file:
//! `{"v":1,"probe":{"bytes":N},"capability":"TOKEN"}`, on a connection of its own, over TLS
//! wherever the data plane is. `TOKEN` is a probe token (`motley_server::capability`,
//! `mint_probe`): signed under the cluster's probe key in the probe domain (so no file
//! capability is a probe token and no probe token reads a file: files are checked under the
//! node's own key only), naming the probed node, valid for `capability::PROBE_EXPIRY_S`; every
//! agent holds the probe key and mints one per probe. The server
//! checks the token first, then `N <= probe::MAX_PROBE_BYTES` (8 MiB), and answers
//! `{"ok":true,"bytes":N}` followed by exactly `N` bytes (zeros, unframed), then closes; or
//! `{"ok":false,"error":"..."}` (no or a bad token, another node's, expired, too many bytes, a
//! data plane started without its node's name). `N` = 0 is a round trip only. Neither end
//! holds more than 64 KiB of a probe at once. Probe bytes are not charged to the node's
//! checkpoint egress pacer (they measure the link; `Access::probe_pacer` can pace them). The
//! server closes a probe's connection `server::PROBE_DEADLINE` (10 s) after its request
//! whether or not all `N` bytes were taken. The asking end may stop reading earlier
//! (`Probe::run_within`, 4 x the agent's probe target) and measure the bytes received by then;
//! its rate is the payload bytes received over the time from the request sent to the last of
//! them (a round trip counted).

pub mod access;
pub mod client;
pub mod limits;
pub mod pace;
pub mod probe;
pub mod protocol;
pub mod resolve;
pub mod server;

pub use access::{Access, ClientTls, DataKey, Issued, Stream};
pub use client::{fetch, fetch_to_path, temporary_path, Peer};
pub use limits::MAX_PROBE_BYTES;
pub use pace::{take_all, Pacer};
pub use probe::{Measured, Probe, ProbeFailed};
pub use protocol::{FileKey, Transport};
pub use resolve::{ckpt_path, restore_path, Arrival, Arriving, DirResolver, Located, Pending, Resolve, Root};
pub use server::serve;
