//! Tests of the head state: node life cycle, placement groups, actors, restart.

use super::*;

/// A node with `gpus` GPUs and 4 CPUs, as it registers.
fn new_gpu_node(gpus: f64) -> NewNode {
    NewNode {
        hostname: "h".into(),
        address: "127.0.0.1:1".into(),
        total: Resources::new().with("GPU", gpus).with("CPU", 4.0),
        cuda_roles: true,
        vllm_roles: false,
    }
}

fn gpu_node(s: &mut HeadState, gpus: f64, now: i64) -> String {
    s.register(None, new_gpu_node(gpus), vec![], now).unwrap()
}

fn live(actor_id: &str, address: &str, pid: i32) -> LiveActor {
    LiveActor {
        actor_id: actor_id.to_string(),
        address: address.into(),
        pid,
        devices: vec![],
        log_file: String::new(),
    }
}

#[test]
fn silent_node_dies_with_its_actors_and_comes_back() {
    let mut s = HeadState::in_memory();
    let a = gpu_node(&mut s, 2.0, 0);
    let b = gpu_node(&mut s, 2.0, 0);
    let actor = s
        .reserve_actor(ActorSpec {
            resources: Resources::new().with("GPU", 1.0),
            ..Default::default()
        })
        .unwrap();
    s.actor_started(&actor.actor_id, "x:1".into(), 7, vec![0], String::new())
        .unwrap();
    assert!(s.heartbeat(&a, 4_000));
    assert!(s.heartbeat(&b, 4_000));
    assert!(s.check_health(8_000, 5_000).unwrap().is_empty());
    assert!(s.heartbeat(&b, 8_000));
    // a last beat at 4s; at 9.1s it has been silent 5.1s.
    let dead = s.check_health(9_100, 5_000).unwrap();
    assert_eq!(dead, vec![a.clone()]);
    assert!(
        s.nodes[&a].death_reason.contains("no heartbeat for 5.1s"),
        "{}",
        s.nodes[&a].death_reason
    );
    assert_eq!(s.nodes[&b].state, NodeState::Alive);
    let act = &s.actors[&actor.actor_id];
    if act.node_id == a {
        assert_eq!(act.state, ActorState::Dead);
        assert!(act.reason.contains("died"));
    }
    // A dead node's heartbeat is refused, so it registers anew.
    assert!(!s.heartbeat(&a, 9_200));
    let again = s
        .register(
            Some(a.clone()),
            NewNode {
                hostname: "h".into(),
                address: "127.0.0.1:1".into(),
                total: Resources::new().with("GPU", 2.0),
                cuda_roles: true,
                vllm_roles: false,
            },
            vec![],
            9_300,
        )
        .unwrap();
    assert_eq!(again, a);
    assert!(s.heartbeat(&a, 9_400));
}

#[test]
fn placement_groups_reserve_and_release() {
    let mut s = HeadState::in_memory();
    let ids: Vec<String> = (0..3).map(|_| gpu_node(&mut s, 2.0, 0)).collect();
    let pg = s
        .create_pg(
            "g",
            Strategy::Spread,
            vec![Resources::new().with("GPU", 2.0); 3],
            false,
        )
        .unwrap();
    let mut on = pg.bundle_nodes.clone();
    on.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(on, want);
    for id in &ids {
        assert_eq!(s.available(id).get("GPU"), 0.0);
    }
    let e = s
        .create_pg(
            "h",
            Strategy::Pack,
            vec![Resources::new().with("GPU", 1.0)],
            false,
        )
        .unwrap_err();
    assert_eq!(e.kind(), FailureKind::InsufficientResources);
    s.remove_pg(&pg.pg_id).unwrap();
    assert_eq!(s.available(&ids[0]).get("GPU"), 2.0);
}

#[test]
fn actors_in_bundles_land_on_the_bundle_node() {
    let mut s = HeadState::in_memory();
    gpu_node(&mut s, 1.0, 0);
    gpu_node(&mut s, 1.0, 0);
    let pg = s
        .create_pg(
            "g",
            Strategy::StrictSpread,
            vec![Resources::new().with("GPU", 1.0); 2],
            false,
        )
        .unwrap();
    let a = s
        .reserve_actor(ActorSpec {
            pg_id: pg.pg_id.clone(),
            bundle_index: 1,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(a.node_id, pg.bundle_nodes[1]);
    assert_eq!(a.spec.resources.get("GPU"), 1.0, "takes the whole bundle");
    let too_big = ActorSpec {
        pg_id: pg.pg_id.clone(),
        resources: Resources::new().with("GPU", 2.0),
        ..Default::default()
    };
    assert!(s
        .reserve_actor(too_big)
        .unwrap_err()
        .to_string()
        .contains("holds {GPU: 1}"));
    let e = s
        .reserve_actor(ActorSpec {
            pg_id: pg.pg_id.clone(),
            bundle_index: 5,
            ..Default::default()
        })
        .unwrap_err();
    assert!(e.to_string().contains("out of range"), "{e}");
}

#[test]
fn state_survives_restart_and_reregistration_reconciles_actors() {
    let dir = tempfile::tempdir().unwrap();
    let (node, kept, lost, starting) = {
        let mut s = HeadState::open(Store::open(dir.path()).unwrap(), 0).unwrap();
        let node = gpu_node(&mut s, 2.0, 0);
        s.create_pg(
            "g",
            Strategy::Pack,
            vec![Resources::new().with("GPU", 1.0)],
            false,
        )
        .unwrap();
        let kept = s.reserve_actor(ActorSpec::default()).unwrap().actor_id;
        let lost = s.reserve_actor(ActorSpec::default()).unwrap().actor_id;
        s.actor_started(&kept, "a:1".into(), 1, vec![], String::new())
            .unwrap();
        s.actor_started(&lost, "a:2".into(), 2, vec![], String::new())
            .unwrap();
        s.kv_put("nccl/id", b"abc".to_vec(), true).unwrap();
        assert!(!s.kv_put("nccl/id", b"zzz".to_vec(), false).unwrap());
        s.kv_put("keys/done", b"x".to_vec(), false).unwrap();
        assert!(s.kv_delete("keys/done").unwrap());
        assert!(!s.kv_delete("keys/done").unwrap());
        // A communicator rendezvous is kept in memory only.
        s.kv_put("comm/weights/1", b"x".to_vec(), false).unwrap();
        assert_eq!(s.kv["comm/weights/1"], b"x");
        // Reserved, never started: a node registering again does not know it yet, so it
        // stays Pending; only a head restart (its CreateActor is gone) ends it.
        let starting = s.reserve_actor(ActorSpec::default()).unwrap().actor_id;
        s.register(
            Some(node.clone()),
            NewNode {
                hostname: "h".into(),
                address: "x".into(),
                total: Resources::new().with("GPU", 2.0),
                cuda_roles: true,
                vllm_roles: false,
            },
            vec![live(&kept, "a:1", 1), live(&lost, "a:2", 2)],
            10,
        )
        .unwrap();
        assert_eq!(s.actors[&starting].state, ActorState::Pending);
        (node, kept, lost, starting)
    };
    let mut s = HeadState::open(Store::open(dir.path()).unwrap(), 50_000).unwrap();
    assert_eq!(s.nodes.len(), 1);
    assert_eq!(s.pgs.len(), 1);
    assert_eq!(s.kv["nccl/id"], b"abc");
    assert!(
        !s.kv.contains_key("comm/done"),
        "a deleted key stays deleted"
    );
    // Grace period: not dead right after the restart, but rejoining: the node may have died
    // while the head was down, so nothing is placed on it until its worker registers again,
    // and a beat from it is answered "register again".
    assert!(s.check_health(51_000, 5_000).unwrap().is_empty());
    assert_eq!(s.nodes[&node].state, NodeState::Rejoining);
    let one_gpu = || vec![Resources::new().with("GPU", 1.0)];
    let e = s
        .create_pg("new", Strategy::Pack, one_gpu(), false)
        .unwrap_err();
    assert_eq!(e.kind(), FailureKind::InsufficientResources);
    assert!(
        e.to_string().contains(&node) && e.to_string().contains("register again"),
        "{e}"
    );
    assert!(!s.heartbeat(&node, 51_000));
    let live = vec![live(&kept, "a:9", 11)];
    s.register(
        Some(node.clone()),
        NewNode {
            hostname: "h".into(),
            address: "x".into(),
            total: Resources::new().with("GPU", 2.0),
            cuda_roles: true,
            vllm_roles: false,
        },
        live,
        51_000,
    )
    .unwrap();
    assert_eq!(s.actors[&kept].state, ActorState::Alive);
    assert_eq!(s.actors[&kept].address, "a:9");
    assert_eq!(s.actors[&lost].state, ActorState::Dead);
    assert!(s.actors[&lost].reason.contains("not running"));
    assert_eq!(s.actors[&starting].state, ActorState::Dead);
    assert!(s.actors[&starting].reason.contains("head restarted"));
    assert_eq!(s.nodes[&node].state, NodeState::Alive);
    s.create_pg("new", Strategy::Pack, one_gpu(), false)
        .unwrap();
}

#[test]
fn a_node_that_does_not_register_again_after_a_head_restart_is_marked_dead() {
    let dir = tempfile::tempdir().unwrap();
    // Ids in this order, so that a node list walked in id order meets the lost one first.
    let (gone, back) = ("node-a-gone".to_string(), "node-b-back".to_string());
    let node = || new_gpu_node(1.0);
    {
        let mut s = HeadState::open(Store::open(dir.path()).unwrap(), 0).unwrap();
        for id in [&gone, &back] {
            s.register(Some(id.clone()), node(), vec![], 0).unwrap();
        }
    }
    let mut s = HeadState::open(Store::open(dir.path()).unwrap(), 10_000).unwrap();
    for n in [&back, &gone] {
        assert_eq!(s.nodes[n].state, NodeState::Rejoining);
    }
    // Not even an actor that asks for nothing lands on a rejoining node.
    let e = s.reserve_actor(ActorSpec::default()).unwrap_err();
    assert!(
        e.to_string().contains(&gone) && e.to_string().contains("register again"),
        "{e}"
    );
    s.register(Some(back.clone()), node(), vec![], 11_000)
        .unwrap();
    assert!(s.check_health(14_000, 5_000).unwrap().is_empty());
    for _ in 0..3 {
        assert_eq!(s.reserve_actor(ActorSpec::default()).unwrap().node_id, back);
    }
    // STRICT_SPREAD over two nodes: only the one that came back offers anything, and the
    // error names the other.
    let two = vec![Resources::new().with("GPU", 1.0); 2];
    let e = s
        .create_pg("g", Strategy::StrictSpread, two, false)
        .unwrap_err();
    assert_eq!(e.kind(), FailureKind::InsufficientResources);
    assert!(
        e.to_string().contains(&gone) && e.to_string().contains("register again"),
        "{e}"
    );
    assert!(s.heartbeat(&back, 15_500));
    assert_eq!(s.check_health(15_500, 5_000).unwrap(), vec![gone.clone()]);
    assert_eq!(s.nodes[&gone].state, NodeState::Dead);
    assert!(
        s.nodes[&gone]
            .death_reason
            .contains("did not register again"),
        "{}",
        s.nodes[&gone].death_reason
    );
    assert_eq!(s.nodes[&back].state, NodeState::Alive);
    // The state on disk says the same after one more restart: dead stays dead.
    drop(s);
    let s = HeadState::open(Store::open(dir.path()).unwrap(), 20_000).unwrap();
    assert_eq!(s.nodes[&gone].state, NodeState::Dead);
    assert_eq!(s.nodes[&back].state, NodeState::Rejoining);
}

#[test]
fn an_actor_in_a_group_waits_for_its_node_to_register_again() {
    let dir = tempfile::tempdir().unwrap();
    let node = {
        let mut s = HeadState::open(Store::open(dir.path()).unwrap(), 0).unwrap();
        let node = gpu_node(&mut s, 1.0, 0);
        s.create_pg(
            "g",
            Strategy::Pack,
            vec![Resources::new().with("GPU", 1.0)],
            false,
        )
        .unwrap();
        node
    };
    let mut s = HeadState::open(Store::open(dir.path()).unwrap(), 10_000).unwrap();
    let pg_id = s.pgs.keys().next().unwrap().clone();
    let spec = ActorSpec {
        pg_id,
        ..ActorSpec::default()
    };
    assert!(s.bundle_node_rejoining(&spec));
    let e = s.reserve_actor(spec.clone()).unwrap_err();
    assert!(e.to_string().contains("has not registered again"), "{e}");
    s.register(Some(node.clone()), new_gpu_node(1.0), vec![], 11_000)
        .unwrap();
    assert!(!s.bundle_node_rejoining(&spec));
    assert_eq!(s.reserve_actor(spec).unwrap().node_id, node);
}

#[test]
fn gpus_of_a_worker_without_cuda_roles_are_not_placed_and_the_error_says_why() {
    let mut s = HeadState::in_memory();
    let cpu_only = s
        .register(
            None,
            NewNode {
                hostname: "laptop".into(),
                address: "127.0.0.1:2".into(),
                total: Resources::new().with("GPU", 4.0).with("CPU", 4.0),
                cuda_roles: false,
                vllm_roles: false,
            },
            vec![],
            1,
        )
        .unwrap();
    let gpu = Resources::new().with("GPU", 1.0);
    let err = s
        .create_pg("job", Strategy::Pack, vec![gpu.clone()], true)
        .unwrap_err()
        .to_string();
    assert!(err.contains(cpu_only.as_str()), "{err}");
    assert!(err.contains("cannot run CUDA roles"), "{err}");
    assert!(err.contains("--features cuda"), "{err}");
    // CPU bundles still land there.
    s.create_pg(
        "cpu",
        Strategy::Pack,
        vec![Resources::new().with("CPU", 1.0)],
        false,
    )
    .unwrap();
    // A worker that can run CUDA roles takes the GPU bundle.
    let cuda = gpu_node(&mut s, 1.0, 2);
    let pg = s
        .create_pg("job2", Strategy::Pack, vec![gpu.clone()], true)
        .unwrap();
    assert_eq!(pg.bundle_nodes, vec![cuda]);
    // A plain group (not CUDA roles) may use any node's GPUs.
    let pg = s
        .create_pg("plain", Strategy::Pack, vec![gpu], false)
        .unwrap();
    assert_eq!(pg.bundle_nodes, vec![cpu_only]);
}

#[test]
fn vllm_groups_land_only_on_workers_with_a_vllm_python_and_the_error_says_how() {
    let mut s = HeadState::in_memory();
    let node = |s: &mut HeadState, name: &str, vllm_roles: bool| {
        s.register(
            None,
            NewNode {
                hostname: name.into(),
                address: format!("127.0.0.1:{}", name.len()),
                total: Resources::new().with("CPU", 4.0),
                cuda_roles: false,
                vllm_roles,
            },
            vec![],
            1,
        )
        .unwrap()
    };
    let plain = node(&mut s, "plain", false);
    let cpu = Resources::new().with("CPU", 2.0);
    let needs = Needs {
        cuda_roles: false,
        vllm_roles: true,
    };
    let err = s
        .create_pg_needing("rollout", Strategy::Pack, vec![cpu.clone()], needs)
        .unwrap_err()
        .to_string();
    assert!(err.contains(plain.as_str()), "{err}");
    assert!(err.contains("--vllm-python"), "{err}");
    let with = node(&mut s, "with-vllm", true);
    let pg = s
        .create_pg_needing("rollout", Strategy::Pack, vec![cpu.clone()], needs)
        .unwrap();
    assert_eq!(pg.bundle_nodes, vec![with]);
    // Groups that need no vLLM still go anywhere (the plain node first: it has room).
    let pg = s
        .create_pg("other", Strategy::Pack, vec![cpu], false)
        .unwrap();
    assert_eq!(pg.bundle_nodes.len(), 1);
}
