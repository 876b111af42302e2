//! What the leader keeps in memory only and rebuilds from heartbeats (docs/state.md): live
//! agents and their outboxes (`fleet`), the link matrix they measure (`links`), their load
//! (`load`), what they told of data planes and restores (`facts`), the job signals (`signals`),
//! and the GPU types the configuration declares (`catalog`, set at start-up).

pub mod catalog;
pub mod facts;
pub mod fleet;
pub mod links;
pub mod load;
pub mod signals;
