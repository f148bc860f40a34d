//! Real processes: this test binary re-runs itself as child ranks, with the test process as
//! rank 0. A child runs the same test (selected by name) and, seeing the environment
//! variables `spawn` set, plays its rank and exits before the test's own body.

mod common;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::{config, pattern};
use rlhf_collective::{
    checksum, BucketedSync, CommConfig, CommSecret, Communicator, Param, ParamMut, ReduceOp,
    ShmCommunicator, ShmRendezvous, TcpCommunicator, TcpRendezvous,
};

const ROLE: &str = "RLHF_COLLECTIVE_TEST_ROLE";
const RANK: &str = "RLHF_COLLECTIVE_TEST_RANK";
const WORLD: &str = "RLHF_COLLECTIVE_TEST_WORLD";
const ADDR: &str = "RLHF_COLLECTIVE_TEST_ADDR";
/// Deadline that only a hang exceeds (every wait on a peer is bounded by a timeout of at
/// most 10 s here); not a speed claim.
const HANG: Duration = Duration::from_secs(120);

/// Parameter sizes (f32 elements) for the sync: one over a bucket, many tiny.
fn sizes() -> Vec<usize> {
    let mut v = vec![300_000, 5, 0, 70_001];
    v.extend((0..40).map(|i| 1 + i % 4));
    v
}

fn trainer_weights() -> Vec<Vec<f32>> {
    sizes()
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            pattern(n, i as u64)
                .into_iter()
                .map(|b| b as f32 / 7.0)
                .collect()
        })
        .collect()
}

/// The work every rank does; returns (sum after all_reduce, checksum after sync).
fn work(c: &mut dyn Communicator) -> rlhf_collective::Result<(f32, u64)> {
    let rank = c.rank();
    let mut v = vec![rank as f32 + 1.0; 100_003];
    c.all_reduce_f32(&mut v, ReduceOp::Sum)?;
    let sync = BucketedSync::new(256 << 10)?;
    let sizes = sizes();
    let sum = if rank == 0 {
        let w = trainer_weights();
        let p: Vec<Param<'_>> = w
            .iter()
            .enumerate()
            .map(|(i, d)| Param::f32(format!("w{i}"), &[sizes[i]], d))
            .collect::<rlhf_collective::Result<_>>()?;
        sync.send(c, &p)?;
        checksum(&p)
    } else {
        let mut w: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
        let mut p: Vec<ParamMut<'_>> = w
            .iter_mut()
            .enumerate()
            .map(|(i, d)| ParamMut::f32(format!("w{i}"), &[sizes[i]], d))
            .collect::<rlhf_collective::Result<_>>()?;
        sync.recv(c, 0, &mut p)?;
        checksum(&p)
    };
    c.barrier()?;
    Ok((v[100_002], sum))
}

/// In a child process started by `spawn`: plays the rank and exits. Returns at once in the
/// test process itself (the variables are not set there).
fn run_child_if_asked() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let get = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("child needs {k}"));
    let rank: usize = get(RANK).parse().unwrap();
    let world: usize = get(WORLD).parse().unwrap();
    let addr = get(ADDR);
    let joined: rlhf_collective::Result<Box<dyn Communicator>> = if addr.starts_with("memfd:") {
        ShmCommunicator::connect(rank, world, &addr, shm_config())
            .map(|c| Box::new(c) as Box<dyn Communicator>)
    } else {
        TcpCommunicator::connect(rank, world, &addr, config(10_000))
            .map(|c| Box::new(c) as Box<dyn Communicator>)
    };
    let mut c = joined.unwrap_or_else(|e| {
        println!("RESULT connect-failed {e}");
        std::process::exit(2)
    });
    match role.as_str() {
        "work" => match work(c.as_mut()) {
            Ok((s, sum)) => {
                println!("RESULT ok {s} {sum:016x}");
                std::process::exit(0)
            }
            Err(e) => {
                println!("RESULT error {e}");
                std::process::exit(3)
            }
        },
        "loop" => {
            let mut v = vec![1.0f32; 1 << 20];
            for _ in 0..100_000 {
                if let Err(e) = c.all_reduce_f32(&mut v, ReduceOp::Avg) {
                    println!(
                        "RESULT error {:?} peer={:?} op={:?} :: {e}",
                        e.kind(),
                        e.peer(),
                        e.op()
                    );
                    std::process::exit(0);
                }
            }
            println!("RESULT loop-finished-without-error");
            std::process::exit(4)
        }
        other => panic!("unknown role {other}"),
    }
}

/// Shared-memory groups in these tests: a secret every rank derives the same way, small
/// slots so a sync crosses the ring many times.
fn shm_config() -> CommConfig {
    let mut c = config(10_000);
    c.secret = Some(CommSecret::from_bytes(&[7; 32]).expect("secret"));
    c
}

/// Kills the child when dropped, so a failing test leaves no stray process.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts rank `rank` as a child running only `test` (the caller), which hands over to
/// `run_child_if_asked` on its first line.
fn spawn(test: &str, role: &str, rank: usize, world: usize, addr: &str) -> KillOnDrop {
    let exe = std::env::current_exe().expect("test binary path");
    let child = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(RANK, rank.to_string())
        .env(WORLD, world.to_string())
        .env(ADDR, addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child rank");
    KillOnDrop(child)
}

/// Waits for the child to exit (bounded) and returns its RESULT line.
fn result_line(mut child: KillOnDrop, limit: Duration) -> (Option<i32>, String) {
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.0.try_wait().expect("wait child") {
            let mut out = String::new();
            if let Some(mut s) = child.0.stdout.take() {
                let _ = s.read_to_string(&mut out);
            }
            // The harness prints "test <name> ... " on the same line.
            let line = out
                .lines()
                .find_map(|l| l.find("RESULT ").map(|i| l[i..].to_string()))
                .unwrap_or_else(|| format!("RESULT <none> in {out:?}"));
            return (status.code(), line);
        }
        assert!(t0.elapsed() < limit, "child did not exit within {limit:?}");
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn child_processes_all_reduce_and_sync_weights() {
    const TEST: &str = "child_processes_all_reduce_and_sync_weights";
    run_child_if_asked();
    let world = 3;
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rv.local_addr().to_string();
    let children: Vec<_> = (1..world)
        .map(|r| spawn(TEST, "work", r, world, &addr))
        .collect();
    let mut c = rv
        .accept(world, config(10_000))
        .expect("rendezvous with child processes");
    let (sum, trainer) = work(&mut c).expect("rank 0 work");
    assert_eq!(sum, 6.0);
    check_children(children, trainer);
}

#[test]
fn child_processes_share_memory_for_all_reduce_and_weight_sync() {
    const TEST: &str = "child_processes_share_memory_for_all_reduce_and_weight_sync";
    run_child_if_asked();
    let world = 3;
    let rv = ShmRendezvous::create(64 << 10).unwrap();
    let addr = rv.address().to_string();
    let children: Vec<_> = (1..world)
        .map(|r| spawn(TEST, "work", r, world, &addr))
        .collect();
    let mut c = rv
        .accept(world, shm_config())
        .expect("shared-memory rendezvous with child processes");
    let (sum, trainer) = work(&mut c).expect("rank 0 work");
    assert_eq!(sum, 6.0);
    check_children(children, trainer);
}

fn check_children(children: Vec<KillOnDrop>, trainer: u64) {
    for (i, child) in children.into_iter().enumerate() {
        let (code, line) = result_line(child, HANG);
        assert_eq!(code, Some(0), "rank {}: {line}", i + 1);
        assert_eq!(
            line,
            format!("RESULT ok 6 {trainer:016x}"),
            "rank {}",
            i + 1
        );
    }
}

#[test]
fn a_killed_process_fails_the_others_within_the_timeout() {
    const TEST: &str = "a_killed_process_fails_the_others_within_the_timeout";
    run_child_if_asked();
    killed_process_case(TEST, false);
}

#[test]
fn a_killed_process_fails_a_shared_memory_group_within_the_timeout() {
    const TEST: &str = "a_killed_process_fails_a_shared_memory_group_within_the_timeout";
    run_child_if_asked();
    killed_process_case(TEST, true);
}

fn killed_process_case(test: &str, shm: bool) {
    let world = 3;
    let timeout = Duration::from_secs(5);
    let mut cfg = if shm {
        shm_config()
    } else {
        CommConfig::default()
    };
    cfg.timeout = timeout;
    enum Rv {
        Tcp(TcpRendezvous),
        Shm(ShmRendezvous),
    }
    let (rv, addr) = if shm {
        let rv = ShmRendezvous::create(256 << 10).unwrap();
        let a = rv.address().to_string();
        (Rv::Shm(rv), a)
    } else {
        let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
        let a = rv.local_addr().to_string();
        (Rv::Tcp(rv), a)
    };
    let survivor = spawn(test, "loop", 1, world, &addr);
    let mut victim = spawn(test, "loop", 2, world, &addr);
    let mut c: Box<dyn Communicator> = match rv {
        Rv::Tcp(rv) => Box::new(rv.accept(world, cfg).expect("rendezvous")),
        Rv::Shm(rv) => Box::new(rv.accept(world, cfg).expect("rendezvous")),
    };
    let mut v = vec![1.0f32; 1 << 20];
    // A few healthy rounds, then SIGKILL rank 2 while the ring is busy.
    for _ in 0..3 {
        c.all_reduce_f32(&mut v, ReduceOp::Avg)
            .expect("healthy round");
    }
    let killer = thread::spawn(move || {
        thread::sleep(Duration::from_millis(20));
        victim.0.kill().expect("kill rank 2");
        victim
    });
    let t0 = Instant::now();
    let err = loop {
        if let Err(e) = c.all_reduce_f32(&mut v, ReduceOp::Avg) {
            break e;
        }
        assert!(t0.elapsed() < HANG, "rank 0 never noticed the dead peer");
    };
    let noticed = t0.elapsed();
    eprintln!("rank 0 noticed the kill after {noticed:?}: {err}");
    drop(killer.join().unwrap());
    // No upper bound on a loaded machine's clock: every wait is bounded by the timeout, and
    // the error kind says which way it ended. A timeout must not fire early, though.
    if err.kind() == rlhf_collective::ErrorKind::Timeout {
        assert!(
            noticed >= timeout,
            "timed out after {noticed:?}, before {timeout:?}"
        );
    }
    assert!(
        matches!(
            err.kind(),
            rlhf_collective::ErrorKind::PeerClosed | rlhf_collective::ErrorKind::Timeout
        ),
        "rank 0: {err}"
    );
    assert!(err.peer().is_some(), "rank 0 error names no peer: {err}");
    let (code, line) = result_line(survivor, HANG);
    eprintln!("rank 1: {line}");
    assert_eq!(code, Some(0), "{line}");
    assert!(
        line.starts_with("RESULT error PeerClosed") || line.starts_with("RESULT error Timeout"),
        "rank 1: {line}"
    );
    assert!(line.contains("op=Some(AllReduce)"), "{line}");
}
