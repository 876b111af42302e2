//! The edges: REST (`rest`), the gRPC control service (`control`) and the agents' gRPC service
//! (`agent`). REST and Control translate requests into the operations (`api`) and their
//! response types into JSON or messages; the agents' service into `store`, `fleet` and
//! `facts`. Errors become status codes here; none holds domain logic. The credentials they
//! check are here.

pub mod agent;
pub mod control;
pub mod rest;

use tonic::Status;

use crate::error::CoordinatorError;

/// A `CoordinatorError` as a gRPC status; a standby's refusal carries the leader's URLs.
pub fn status_of(e: CoordinatorError) -> Status {
    let mut status = Status::new(tonic::Code::from(e.grpc_code()), e.to_string());
    if let CoordinatorError::NotLeader { rest_url, grpc_url } = &e {
        for (key, url) in [("motley-leader", rest_url), ("motley-leader-grpc", grpc_url)] {
            if let Ok(v) = url.parse() {
                status.metadata_mut().insert(key, v);
            }
        }
    }
    status
}

pub use motley_server::auth::{bearer, same_secret};

/// The two credentials: operators' (the control API) and agents' (the agent service and the
/// agents' log service). Either is None only with `--insecure`.
#[derive(Clone, Default)]
pub struct Tokens {
    pub operator: Option<String>,
    pub agent: Option<String>,
}

impl Tokens {
    /// A control API call: the operators' token. The agents' token is recognised and refused
    /// (403): a GPU node's credential must never open the control API.
    pub fn check_operator(&self, given: Option<&str>) -> Result<(), CoordinatorError> {
        let Some(expected) = &self.operator else { return Ok(()) };
        match given {
            Some(g) if same_secret(g, expected) => Ok(()),
            Some(g) if self.agent.as_deref().is_some_and(|a| same_secret(g, a)) => Err(CoordinatorError::PermissionDenied(
                "this is the agents' token; the control API takes the operators' token (--token, MOTLEY_TOKEN)".into(),
            )),
            _ => Err(CoordinatorError::Unauthenticated("missing or wrong bearer token; pass --token or set MOTLEY_TOKEN".into())),
        }
    }

    /// An agent service call: the agents' token.
    pub fn check_agent(&self, given: Option<&str>) -> Result<(), CoordinatorError> {
        let Some(expected) = &self.agent else { return Ok(()) };
        match given {
            Some(g) if same_secret(g, expected) => Ok(()),
            _ => Err(CoordinatorError::Unauthenticated(
                "wrong or missing agent token; pass the coordinator's agent token (its --agent-token, or DATA_DIR/agent-token) as the agent's --token or MOTLEY_TOKEN"
                    .into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_token_opens_its_own_door_only() {
        let t = Tokens { operator: Some("op".into()), agent: Some("ag".into()) };
        assert!(t.check_operator(Some("op")).is_ok() && t.check_agent(Some("ag")).is_ok());
        assert!(matches!(t.check_operator(Some("ag")), Err(CoordinatorError::PermissionDenied(_))));
        assert!(matches!(t.check_operator(None), Err(CoordinatorError::Unauthenticated(_))));
        assert!(matches!(t.check_agent(Some("op")), Err(CoordinatorError::Unauthenticated(_))));
    }
}
