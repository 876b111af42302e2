//! Research tools, apart from the product: the planners Motley is measured against, reproduced
//! on their own inputs. [`metis`] reads Metis's profiles, hostfile and clusterfile, prices a plan
//! exactly as Metis's code does and searches its space (and its union with Motley's) exactly;
//! [`espresso`] reads Espresso's job, model and GPU files, reproduces its estimator bit for bit,
//! replays its placer and allocator, and searches its space exactly. [`commands`] are the
//! `motley-baselines metis|espresso` commands. The product (`motley`, the coordinator, the agent)
//! links none of this; this crate uses the planner's public cost model, never the other way.

pub mod commands;
pub mod error;
pub mod espresso;
pub mod metis;

pub use error::{BaselineError, Result};
