//! The memory and the threads restores use: every buffer a restore reads or writes file bytes
//! through (a local copy's piece, a cloud piece, a peer flow's frame, a verification pass) takes
//! its MiB from one budget of `BUFFER_BUDGET_MIB` for the whole agent, so the files in flight
//! cost at most that much, however many and however large; blocking file work runs on tokio's
//! blocking pool. Below `sources` and `verify`, which both read and write through it; calls
//! nothing of the crate.

use tokio::sync::{Semaphore, SemaphorePermit};

/// MiB of file buffers all restores of this agent hold at once (docs/recovery.md, "Limits").
pub const BUFFER_BUDGET_MIB: u32 = 128;
/// The buffer a verification pass or a local copy reads through (MiB): a chunk's crc is
/// accumulated across reads, whatever the manifest's chunk size.
pub(super) const IO_BUFFER: usize = 1 << 20;

static BUFFERS: Semaphore = Semaphore::const_new(BUFFER_BUDGET_MIB as usize);

/// Take `mib` MiB of the agent's restore buffer budget until the permit drops.
pub(super) async fn buffer(mib: u32) -> SemaphorePermit<'static> {
    BUFFERS.acquire_many(mib.min(BUFFER_BUDGET_MIB)).await.expect("the buffer budget is never closed")
}

/// Run blocking file work on tokio's blocking pool, never on an async worker.
pub(super) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, String> + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(format!("a file task ended: {e}")))
}
