//! Helpers shared by the cluster tests (cluster.rs and cluster_lifecycle.rs): clients of
//! the head and of actors, placement requests, a three-worker cluster.
#![allow(dead_code)] // each test file uses its own subset

use std::time::Duration;

use anyhow::Result;
use rlhf_e2e::Cluster;
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::actor_service_client::ActorServiceClient;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::net::{self, AuthChannel, ClientOptions};

pub(crate) fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().expect("runtime")
}

pub(crate) async fn head_client(c: &Cluster) -> Result<HeadServiceClient<AuthChannel>> {
    let mut o = ClientOptions::new(c.token()?);
    o.connect_timeout = Duration::from_secs(10);
    Ok(HeadServiceClient::new(
        net::connect(&c.address(), &o).await?,
    ))
}

pub(crate) async fn actor_client(
    c: &Cluster,
    addr: &str,
) -> Result<ActorServiceClient<AuthChannel>> {
    let mut o = ClientOptions::new(c.token()?);
    o.connect_timeout = Duration::from_secs(5);
    Ok(ActorServiceClient::new(net::connect(addr, &o).await?))
}

pub(crate) fn gpu_bundles(n: usize, gpus: f64) -> Vec<pb::Bundle> {
    (0..n)
        .map(|_| pb::Bundle {
            resources: Some(pb::Resources {
                amounts: [("GPU".to_string(), gpus)].into(),
            }),
        })
        .collect()
}

pub(crate) fn pg_req(
    name: &str,
    strategy: pb::PlacementStrategy,
    n: usize,
    gpus: f64,
    timeout_ms: u64,
) -> pb::CreatePlacementGroupRequest {
    pb::CreatePlacementGroupRequest {
        name: name.into(),
        strategy: strategy as i32,
        bundles: gpu_bundles(n, gpus),
        timeout_ms,
        cuda_roles: false,
        vllm_roles: false,
    }
}

pub(crate) fn test_actor(pg_id: &str, bundle: i32) -> pb::CreateActorRequest {
    pb::CreateActorRequest {
        spec: Some(pb::ActorSpec {
            name: "echo".into(),
            role: "test".into(),
            kind: "test".into(),
            pg_id: pg_id.into(),
            bundle_index: bundle,
            ..Default::default()
        }),
        timeout_ms: 20_000,
    }
}

pub(crate) fn three_node_cluster(extra_head: &[&str]) -> Result<Cluster> {
    let mut c = Cluster::start(extra_head)?;
    c.add_worker(r#"{"GPU": 1, "CPU": 2}"#)?;
    c.add_worker(r#"{"GPU": 2, "CPU": 4, "special": 1}"#)?;
    c.add_worker(r#"{"GPU": 4, "CPU": 8}"#)?;
    c.wait_alive_nodes(3, Duration::from_secs(30))?;
    Ok(c)
}
