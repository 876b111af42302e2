//! The gRPC control service (`proto/motley/v1/control.proto`): a thin edge that checks the
//! bearer token and leadership, takes the request's fields, calls the operation (`api`) and
//! turns its response into the message (`messages`: one `From` per type). Errors become
//! statuses through `CoordinatorError::grpc_code`, as REST's through `http_status`.

mod messages;

use std::pin::Pin;
use std::sync::Arc;

use motley_proto::v1 as pb;
use motley_proto::v1::control_server::Control;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::api::Operations;
use crate::server::leader::Role;
use crate::service::{status_of, Tokens};
use crate::state::fleet::Fleet;
use crate::store::Store;

pub struct ControlService {
    pub store: Store,
    pub fleet: Arc<Fleet>,
    pub life: Arc<crate::life::Life>,
    pub role: Arc<Role>,
    /// The operators' token every call must carry (the agents' is refused).
    pub tokens: Tokens,
}

type Reply<T> = Result<Response<T>, Status>;

/// An operation's answer as the call's reply.
fn reply<T, M: From<T>>(r: crate::Result<T>) -> Reply<M> {
    r.map(|v| Response::new(v.into())).map_err(status_of)
}

impl ControlService {
    /// The token, then leadership: every call but `GetLeader` needs both.
    fn admit<T>(&self, req: &Request<T>) -> Result<(), Status> {
        self.authenticate(req)?;
        if !self.role.is_leader() {
            return Err(status_of(self.role.not_leader()));
        }
        Ok(())
    }

    fn authenticate<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let given = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).and_then(crate::service::bearer);
        self.tokens.check_operator(given).map_err(status_of)
    }

    fn ops(&self) -> Operations<'_> {
        Operations { store: &self.store, fleet: &self.fleet, life: &self.life, role: &self.role }
    }
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn get_network(&self, req: Request<pb::GetNetworkRequest>) -> Reply<pb::Network> {
        self.admit(&req)?;
        reply(self.ops().network(Some(req.into_inner().node.as_str())).await)
    }

    async fn list_checkpoints(&self, req: Request<pb::JobRef>) -> Reply<pb::CheckpointSteps> {
        self.admit(&req)?;
        let steps = self.ops().checkpoints(req.into_inner().id).await.map_err(status_of)?;
        Ok(Response::new(pb::CheckpointSteps { steps: steps.into_iter().map(Into::into).collect() }))
    }

    async fn get_checkpoint_grid(&self, req: Request<pb::CheckpointGridRequest>) -> Reply<pb::CheckpointGrid> {
        self.admit(&req)?;
        let r = req.into_inner();
        reply(self.ops().checkpoint_grid(r.job, r.step).await)
    }

    async fn list_profiles(&self, req: Request<pb::ListProfilesRequest>) -> Reply<pb::ProfileList> {
        self.admit(&req)?;
        let hash = req.into_inner().model_hash;
        let rows = self.ops().profiles(Some(hash.as_str()).filter(|h| !h.is_empty())).await.map_err(status_of)?;
        Ok(Response::new(pb::ProfileList { profiles: rows.into_iter().map(Into::into).collect() }))
    }

    async fn get_profile(&self, req: Request<pb::ProfileRef>) -> Reply<pb::StoredProfile> {
        self.admit(&req)?;
        reply(self.ops().profile(req.into_inner().id).await)
    }

    async fn run_profile(&self, req: Request<pb::ProfileRunRequest>) -> Reply<pb::ProfileRun> {
        self.admit(&req)?;
        reply(self.ops().run_profile(&req.into_inner().text).await)
    }

    async fn get_profile_run(&self, req: Request<pb::ProfileRunRef>) -> Reply<pb::ProfileRun> {
        self.admit(&req)?;
        reply(self.ops().profile_run(req.into_inner().request).await)
    }

    async fn list_nodes(&self, req: Request<pb::ListNodesRequest>) -> Reply<pb::NodeList> {
        self.admit(&req)?;
        let nodes = self.ops().nodes().await.map_err(status_of)?;
        Ok(Response::new(pb::NodeList { nodes: nodes.into_iter().map(Into::into).collect() }))
    }

    async fn describe_node(&self, req: Request<pb::NodeRef>) -> Reply<pb::Node> {
        self.admit(&req)?;
        reply(self.ops().node(&req.into_inner().name).await)
    }

    async fn drain_node(&self, req: Request<pb::DrainNodeRequest>) -> Reply<pb::Node> {
        self.admit(&req)?;
        let req = req.into_inner();
        reply(self.ops().drain_node(&req.name, req.deadline_s).await)
    }

    async fn undrain_node(&self, req: Request<pb::NodeRef>) -> Reply<pb::Node> {
        self.admit(&req)?;
        reply(self.ops().undrain_node(&req.into_inner().name).await)
    }

    async fn submit_job(&self, req: Request<pb::JobFile>) -> Reply<pb::Job> {
        self.admit(&req)?;
        reply(self.ops().submit(&req.into_inner().text).await)
    }

    async fn list_jobs(&self, req: Request<pb::ListJobsRequest>) -> Reply<pb::JobList> {
        self.admit(&req)?;
        let jobs = self.ops().jobs().await.map_err(status_of)?;
        Ok(Response::new(pb::JobList { jobs: jobs.into_iter().map(Into::into).collect() }))
    }

    async fn get_job(&self, req: Request<pb::JobRef>) -> Reply<pb::Job> {
        self.admit(&req)?;
        reply(self.ops().job(req.into_inner().id).await)
    }

    type WatchJobStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send>>;

    async fn watch_job(&self, req: Request<pb::WatchJobRequest>) -> Reply<Self::WatchJobStream> {
        self.admit(&req)?;
        let pb::WatchJobRequest { id, after } = req.into_inner();
        let events = self.ops().watch(id, after).await.map_err(status_of)?;
        // Dropping this stream (the watcher left) drops the receiver, which ends the poll.
        let stream = ReceiverStream::new(events).map(|e| e.map(pb::Event::from).map_err(status_of));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn cancel_job(&self, req: Request<pb::JobRef>) -> Reply<pb::Job> {
        self.admit(&req)?;
        reply(self.ops().cancel(req.into_inner().id).await)
    }

    async fn get_plan(&self, req: Request<pb::JobRef>) -> Reply<pb::JobPlan> {
        self.admit(&req)?;
        reply(self.ops().plan(req.into_inner().id).await)
    }

    async fn dry_run_plan(&self, req: Request<pb::JobFile>) -> Reply<pb::DryRun> {
        self.admit(&req)?;
        reply(self.ops().dry_run(&req.into_inner().text).await)
    }

    async fn get_leader(&self, req: Request<pb::LeaderRequest>) -> Reply<pb::Leader> {
        self.authenticate(&req)?;
        Ok(Response::new(self.ops().leader().into()))
    }
}
