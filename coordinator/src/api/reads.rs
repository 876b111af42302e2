//! Checkpoint locations, layer profiles and profile runs, the link matrix, and who leads.

use serde::Serialize;

use super::Operations;
use crate::error::{CoordinatorError, Result};
use crate::planning::profiling::{ProfileRun, RunRequest};
use crate::store::ProfileRecord;
use crate::views::checkpoints::{StepGrid, StepView};

pub use motley_contract::net::NetworkView;

/// The link matrix as both doors show it (`net`): the view is its JSON.
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct Network(pub NetworkView);

/// Who leads (answered by standbys too).
#[derive(Serialize, utoipa::ToSchema)]
pub struct LeaderView {
    pub is_leader: bool,
    pub rest_url: String,
    pub grpc_url: String,
    pub term: i64,
    /// This cluster's identity (made once, kept in its database): its jobs' checkpoint-cloud
    /// prefixes carry it (`URL/CLUSTER/jobs/JOB/GEN/step-S`).
    pub cluster_id: String,
}

impl Operations<'_> {
    /// The job's checkpoint steps some node holds, newest first.
    pub async fn checkpoints(&self, job: i64) -> Result<Vec<StepView>> {
        crate::views::checkpoints::steps(self.store, job).await
    }

    /// One step (default: the newest complete one, else the newest): a row per file.
    pub async fn checkpoint_grid(&self, job: i64, step: Option<i64>) -> Result<StepGrid> {
        crate::views::checkpoints::grid(self.store, job, step).await
    }

    /// The stored layer profiles, or only those of one model hash.
    pub async fn profiles(&self, model_hash: Option<&str>) -> Result<Vec<ProfileRecord>> {
        self.store.profiles(model_hash).await
    }

    pub async fn profile(&self, id: i64) -> Result<ProfileRecord> {
        self.store.profile(id).await
    }

    /// Measure one profile now on a live agent that can profile; `text` is the request as
    /// JSON or YAML.
    pub async fn run_profile(&self, text: &str) -> Result<ProfileRun> {
        let run: RunRequest = crate::job::spec::parse_yaml(serde_norway::Deserializer::from_str(text), "profile run")?;
        crate::planning::profiling::run_now(self.store, self.fleet, &run).await
    }

    /// The runs sent to agents, newest first.
    pub async fn profile_runs(&self) -> Result<Vec<ProfileRun>> {
        crate::planning::profiling::runs(self.store, self.fleet).await
    }

    pub async fn profile_run(&self, request: i64) -> Result<ProfileRun> {
        crate::planning::profiling::run(self.store, self.fleet, request).await?.ok_or_else(|| {
            CoordinatorError::not_found(format!("profile run {request} (ended runs are kept for a while: motley profile runs)"))
        })
    }

    /// The link matrix, or one node's links and NICs (`None` or empty: every node).
    pub async fn network(&self, node: Option<&str>) -> Result<Network> {
        crate::views::net::view(self.store, self.fleet, node).await.map(Network)
    }

    pub fn leader(&self) -> LeaderView {
        let l = self.role.leader();
        LeaderView {
            is_leader: self.role.is_leader(),
            rest_url: l.rest_url,
            grpc_url: l.grpc_url,
            term: l.term,
            cluster_id: self.store.cluster().id.clone(),
        }
    }
}
