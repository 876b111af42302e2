//! The gRPC contracts: coordinator and agents (`motley/v1/agent.proto`), operators and
//! schedulers (`motley/v1/control.proto`),
//! compiled at build time with protox (no protoc needed).

/// prost's trait, for a message's encoded length (`Message::encoded_len`) without a direct
/// dependency on prost.
pub use prost::Message;

pub mod v1 {
    tonic::include_proto!("motley.v1");
}
