//! The `motley` CLI's library half: reading input files and rendering plans, so tests can
//! reach them without spawning the binary.

pub mod dev;
pub mod espresso;
pub mod inputs;
pub mod metis;
pub mod metis_motley;
pub mod plan;
pub mod provision;
pub mod remote;
pub mod table;
