//! The gRPC contracts: coordinator and agents (`motley/v1/agent.proto`), operators and
//! schedulers (`motley/v1/control.proto`),
//! compiled at build time with protox (no protoc needed).

pub mod v1 {
    tonic::include_proto!("motley.v1");
}
