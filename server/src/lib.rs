//! What the coordinator and the agents serve with, one implementation for both so they cannot
//! drift: the config files under `/etc/motley/` (`config`, one loader for every daemon), HTTPS
//! in front of an axum router (`serve`), bearer tokens (`auth`), and the data plane's
//! capabilities (`capability`: what a fetching agent shows a serving one, minted by the
//! coordinator, checked by agents). The documents they exchange are `motley_contract`'s; the
//! planner and the CLI link none of this.

pub mod auth;
pub mod capability;
pub mod config;
pub mod error;
pub mod serve;

pub use error::ServerError;
