//! The data plane's bounds that its serving and asking ends share: how long a connection may
//! take to say what it wants, how many connections a server holds, and how large a probe is
//! and in what pieces it moves. Below `access`, `server`, `client` and `probe`; calls nothing.

use std::time::Duration;

/// The longest a new connection may take for its TLS handshake and request line together
/// (`DataKey::request_deadline`: two base intervals, within 1 s and this). A client sends its
/// line as soon as it is connected; this is the TLS handshake bound of the agent's other TLS
/// service (`motley_server::serve`), and a third of the 30 s the restorer waits on a peer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once (`Access::max_connections`): a restoring node opens at most a
/// few hundred at a time (`restorer::run`'s bound on files in flight), and each holds a socket
/// and a file open. Beyond it connections wait, unread, in the listen queue, so a peer that
/// opens thousands costs this agent no more than this many tasks and descriptors.
pub const MAX_CONNECTIONS: usize = 512;
/// Connections one source address may hold at once (`Access::max_per_source`): a restoring
/// agent has at most 128 connections open, one per MiB of its restore buffers
/// (`restorer::budget::BUFFER_BUDGET_MIB`), and a probing one a single connection. A peer
/// that opens more (a rank that can reach the port, connecting and saying nothing) holds a
/// quarter of `MAX_CONNECTIONS` at most, and its connections beyond it are closed at once
/// rather than queued, so the other nodes' restores are still served.
pub const MAX_PER_SOURCE: usize = 128;
/// The most payload bytes one probe may ask for; a larger probe is refused before any byte.
pub const MAX_PROBE_BYTES: u64 = 8 << 20;
/// The chunk of a probe the server writes and the client reads: every buffer of a probe is this
/// large at most, whatever the peer says.
pub(super) const PROBE_CHUNK: usize = 64 << 10;
/// A probe's payload: zeros (probes measure the link, not the bytes).
pub(super) static PROBE_ZEROS: [u8; PROBE_CHUNK] = [0; PROBE_CHUNK];
