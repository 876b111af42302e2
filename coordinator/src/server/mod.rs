//! The process around the rooms: who leads (`leader`), the leader's tasks watched
//! (`supervise`), `/metrics` (`metrics`), OTLP traces (`telemetry`), certificates (`tls`).

pub mod leader;
pub mod metrics;
pub mod supervise;
pub mod telemetry;
pub mod tls;
