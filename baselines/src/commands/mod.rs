//! `motley-baselines metis|espresso`: the flags and outputs that `motley metis` and `motley
//! espresso` had, read and answered as `motley` does (`-o table|json`, one-line errors, exit 2).

pub mod espresso;
pub mod metis;
pub mod metis_inputs;
pub mod metis_motley;
