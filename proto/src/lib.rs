//! The gRPC contract between the coordinator and the agents (`motley/v1/agent.proto`),
//! compiled at build time with protox (no protoc needed).

pub mod v1 {
    tonic::include_proto!("motley.v1");
}
