//! Metis on its own ground: its inputs, its cost model, its plan space, searched exactly.
//!
//! Metis (USENIX ATC'24) and ImprovedMetis plan one pipeline whose stages each run as
//! (dp, tp) on a power-of-two group of consecutive global ranks, GPU types taking ranks one
//! type after another. This module reads their profile directory, hostfile and clusterfile
//! ([`input`]), prices a plan exactly as their code does ([`cost`]), and finds the cheapest
//! plan of their space or of the union with Motley's by branch and bound ([`search`]).

pub mod cost;
pub mod input;
pub mod motley_search;
pub mod motley_view;
pub mod plan;
pub mod search;
pub mod walk;

pub use cost::{Layout, MetisCost, MetisModel, MetisSettings, Quirks};
pub use input::{MetisCluster, MetisProfiles};
pub use plan::MetisPlan;
pub use search::{search, SearchOutcome, Space};
