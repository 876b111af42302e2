//! A job's vocabulary: its life (submitted -> planning -> launching -> running -> succeeded |
//! failed | cancelled; the rules live with the job views clients read, `motley_contract::job`,
//! and the store applies them inside its transactions), the job file (`spec`), the names that
//! reach files and terminals (`validate`), and where its checkpoints go (`cluster`). Pure: no
//! room below it.

pub mod cluster;
pub mod spec;
pub mod validate;

pub use motley_contract::job::JobState;
