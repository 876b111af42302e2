//! The operations both doors serve (docs/architecture.md, room `api`): each is a method from a
//! request to a response type, and holds what REST and gRPC Control would otherwise each do
//! (reading the store and the fleet, composing a node's liveness and load, a job's checkpoint
//! cloud and queued reason, parsing bodies, calling `control`). The response types are plain
//! serde structs: REST serialises them as they are (they are the JSON), the gRPC door turns
//! each into its message with one `From`. Nothing here knows HTTP or protobuf.

pub mod control;
mod jobs;
mod nodes;
mod reads;

use crate::life::Life;
use crate::server::leader::Role;
use crate::state::fleet::Fleet;
use crate::store::Store;

pub use jobs::{DryRunView, Job, PlanView};
pub use nodes::{Declared, Node};
pub use reads::{LeaderView, Network};

/// The rooms the operations read and drive, borrowed from a door for one call.
#[derive(Clone, Copy)]
pub struct Operations<'a> {
    pub store: &'a Store,
    pub fleet: &'a Fleet,
    /// The job controller: drains, and why queued jobs wait.
    pub life: &'a Life,
    pub role: &'a Role,
}
