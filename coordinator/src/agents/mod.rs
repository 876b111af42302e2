//! The coordinator's side of what goes to agents and comes back, below the job's life: launch
//! instructions out, stops and fenced job moves (`launch`); an agent's status applied
//! (`reports`). The gRPC edge (`service::agent`) only translates into these.

pub mod launch;
pub mod reports;
