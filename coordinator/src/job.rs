//! A job's life (submitted -> planning -> launching -> running -> succeeded | failed |
//! cancelled): the rules live with the job views clients read (`motley_contract::job`); the
//! store applies them inside its transactions.

pub use motley_contract::job::JobState;
