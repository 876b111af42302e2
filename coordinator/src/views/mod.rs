//! Reads as people see them: the checkpoint-location bitmap (`checkpoints`), the live link
//! matrix beside the declared rates (`net`), ranks' logs and training curves (`rank_logs`).
//! They read the store and the fleet and change nothing.

pub mod checkpoints;
pub mod net;
pub mod rank_logs;
