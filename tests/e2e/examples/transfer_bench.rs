//! Experience-batch transfer bench: a DataBatch put with `PutBatch` to a real actor process
//! (the process is this program serving the built-in test actor, as a worker would), each
//! path next to its own baseline measured in the same run on the same bytes:
//!
//! - streamed over gRPC (encode, stream, decode and checksum on the actor), and as raw
//!   control frames beside the call (`rlhf_runtime::frames::batch`: the tensors written from
//!   where they live, read into a pooled buffer and viewed in place, checksummed on the
//!   actor), each vs a tuned raw TCP copy between the same two processes (the
//!   communicator's socket buffers, the connection made before timing, a reused receive
//!   buffer): goal >= 0.9 (what goes between hosts); and, for the frames, the same raw copy
//!   whose receiver then does what the actor does with a batch (views it, checksums it);
//! - through shared memory on this host (the batch written once into a sealed memory file,
//!   mapped and checksummed by the actor; `rlhf_runtime::shared_batch`) vs a `memcpy` of
//!   the same bytes in this process: goal >= 0.5.
//!
//! Each size runs `--reps` times, alternating the paths, and the medians are compared.
//! Also prints the in-process cost of encoding into chunks and of reassembling them.
//!
//! `--tls`: the actor serves with a certificate made for the run and the gRPC stream and the
//! frames both go inside TLS (as on a TLS cluster); the raw copy stays plain, so its ratio
//! shows what encryption costs, and the frames are compared with the stream in TLS too.
//!
//! Run: `cargo build --release --workspace --bins --examples`, then
//! `target/release/examples/transfer_bench [--sizes 64,256 --reps 5 --chunk-kib 1024 --tls]`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rlhf_core::batch::{self, DataBatch, TensorData};
use rlhf_proto::v1::actor_service_client::ActorServiceClient;
use rlhf_runtime::frames::FramedBatch;
use rlhf_runtime::net::{self, ClientOptions};
use rlhf_runtime::shared_batch::SharedFile;
use tonic::codegen::tokio_stream;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// CPU seconds (user + system) a process has used so far, from /proc.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = s.rsplit(')').next().context("stat format")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is index 0, utime 11, stime 12 (clock ticks).
    let ticks = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

/// How a batch goes to the actor process.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    /// A gRPC stream of chunks over HTTP/2.
    Streamed,
    /// A sealed memory file on this host.
    Shared,
    /// Raw control frames beside the call.
    Framed,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A batch of `mib` MiB shaped like rollout output: one big f32 tensor and a small
/// i64 one, 256 rows, a prompt column.
fn make_batch(mib: usize) -> Result<DataBatch> {
    let rows = 256;
    let ids_per_row = 64;
    let small = rows * ids_per_row * 8;
    let floats = ((mib << 20) - small) / 4 / rows * rows;
    let data: Vec<f32> = (0..floats).map(|i| (i % 1009) as f32).collect();
    let ids: Vec<i64> = (0..(rows * ids_per_row) as i64).collect();
    Ok(DataBatch::new()
        .with_tensor(
            "values",
            TensorData::from_f32(vec![rows, floats / rows], &data)?,
        )
        .with_tensor(
            "input_ids",
            TensorData::from_i64(vec![rows, ids_per_row], &ids)?,
        )
        .with_column(
            "prompt",
            (0..rows)
                .map(|i| serde_json::json!(format!("prompt {i}")))
                .collect(),
        ))
}

/// Checks the raw copy's receiver runs on what it received, when asked to: the same work as
/// the frames receiver does after reading (decode as views of the buffer, checksum).
struct Received(Vec<u8>);

impl batch::SharedRegion for Received {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Set in the length word: the receiver views and checksums the batch before answering.
const CHECK: u64 = 1 << 63;

/// The receiving end of the raw copy, in the actor process: one connection with the
/// communicator's socket settings; each copy is a length, then that many bytes read into a
/// buffer reused across copies, answered with 8 bytes (the batch's checksum when the length
/// word asked for it, else 0).
fn serve_raw(l: TcpListener) -> Result<()> {
    let (mut s, _) = l.accept()?;
    rlhf_collective::tcp::tune_stream(&s, &rlhf_collective::CommConfig::default());
    let mut buf = Vec::new();
    loop {
        let mut len = [0u8; 8];
        if s.read_exact(&mut len).is_err() {
            return Ok(());
        }
        let len = u64::from_le_bytes(len);
        buf.resize((len & !CHECK) as usize, 0);
        s.read_exact(&mut buf)?;
        let mut sum = 0;
        if len & CHECK != 0 {
            let region = std::sync::Arc::new(Received(std::mem::take(&mut buf)));
            let b = batch::decode_view(region.clone(), 0)?;
            sum = batch::checksum(&b);
            drop(b);
            buf = std::sync::Arc::try_unwrap(region)
                .map_err(|_| anyhow::anyhow!("a view of the received batch outlived it"))?
                .0;
        }
        s.write_all(&sum.to_le_bytes())?;
    }
}

/// The raw copy's sending end, connected before any timing.
struct RawLink(TcpStream);

impl RawLink {
    fn connect(addr: &str) -> Result<Self> {
        let s = TcpStream::connect(addr)?;
        rlhf_collective::tcp::tune_stream(&s, &rlhf_collective::CommConfig::default());
        Ok(Self(s))
    }

    /// One copy of `src` to the actor process, until its answer (the checksum it computed
    /// when `check`).
    fn copy(&mut self, src: &[u8], check: bool) -> Result<(f64, u64)> {
        let t = Instant::now();
        let flag = if check { CHECK } else { 0 };
        self.0.write_all(&(src.len() as u64 | flag).to_le_bytes())?;
        for c in src.chunks(rlhf_collective::CommConfig::default().chunk_bytes) {
            self.0.write_all(c)?;
        }
        let mut sum = [0u8; 8];
        self.0.read_exact(&mut sum)?;
        Ok((t.elapsed().as_secs_f64(), u64::from_le_bytes(sum)))
    }
}

/// The actor process: this same program, serving the built-in test actor (the code a
/// worker runs for `kind: "test"`), so the bench needs no head or worker; and the raw
/// copy's receiver, whose address goes to `READY.raw`.
fn serve_actor(ready_file: &str, token: &str, tls: net::ServerTls) -> Result<()> {
    let raw = TcpListener::bind("127.0.0.1:0")?;
    let raw_ready = format!("{ready_file}.raw");
    std::fs::write(format!("{raw_ready}.tmp"), raw.local_addr()?.to_string())?;
    std::fs::rename(format!("{raw_ready}.tmp"), &raw_ready)?;
    std::thread::spawn(move || {
        if let Err(e) = serve_raw(raw) {
            eprintln!("the raw copy's receiver failed: {e:#}");
        }
    });
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(rlhf_runtime::actor::run(
        rlhf_runtime::actor::ActorOptions {
            actor_id: "bench-actor".into(),
            kind: "test".into(),
            ready_file: ready_file.into(),
            host: "127.0.0.1".into(),
            token: token.into(),
            tls,
        },
        tokio_util::sync::CancellationToken::new(),
    ))?;
    Ok(())
}

/// Kills the actor process when the bench ends, however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The actor process (serving with `tls`'s certificate and key, if any), its RPC address
/// and its raw copy receiver's address.
fn spawn_actor(token: &str, tls: &net::ServerTls) -> Result<(Child, String, String)> {
    let dir = tempfile::tempdir()?;
    let ready = dir.path().join("actor.ready");
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("--serve-actor").arg(&ready).arg(token);
    if let (Some(c), Some(k)) = (&tls.cert, &tls.key) {
        cmd.arg(c).arg(k);
    }
    let child = Child(cmd.spawn().context("starting the actor process")?);
    let t = Instant::now();
    loop {
        let raw = std::fs::read_to_string(ready.with_extension("ready.raw"));
        if let (Ok(addr), Ok(raw)) = (std::fs::read_to_string(&ready), raw) {
            return Ok((child, addr.trim().to_string(), raw.trim().to_string()));
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(20),
            "the actor process did not announce its address within 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let (Some("--serve-actor"), Some(ready), Some(token)) =
        (args.get(1).map(String::as_str), args.get(2), args.get(3))
    {
        let tls = net::ServerTls {
            cert: args.get(4).map(Into::into),
            key: args.get(5).map(Into::into),
            ca: None,
        };
        return serve_actor(ready, token, tls);
    }
    let tls_dir = tempfile::tempdir()?;
    let mut tls = net::ServerTls::default();
    let mut o = ClientOptions::new("transfer-bench-token");
    if args.iter().any(|a| a == "--tls") {
        let (cert, key, ca) = rlhf_e2e::node_cert(tls_dir.path())?;
        (tls.cert, tls.key) = (Some(cert), Some(key));
        o.tls_ca = Some(ca);
    }
    let sizes: Vec<usize> = arg("--sizes")
        .unwrap_or_else(|| "64,256".into())
        .split(',')
        .map(|s| s.trim().parse().context("--sizes takes MiB like 64,256"))
        .collect::<Result<_>>()?;
    let reps: usize = arg("--reps").map_or(Ok(5), |s| s.parse())?;
    let chunk = arg("--chunk-kib").map_or(Ok(batch::CHUNK_BYTES), |s| {
        s.parse::<usize>().map(|k| k << 10)
    })?;
    anyhow::ensure!(reps > 0, "--reps must be at least 1");

    let rt = tokio::runtime::Runtime::new()?;
    let token = o.token.clone();
    let (actor, addr, raw_addr) = spawn_actor(&token, &tls)?;
    let mut raw_link = RawLink::connect(&raw_addr)?;
    let actor_pid = actor.0.id();
    let mut client =
        rt.block_on(async { anyhow::Ok(ActorServiceClient::new(net::connect(&addr, &o).await?)) })?;
    // The connection a driver makes to a role process: control frames where it speaks them.
    let mut direct = rt.block_on(async {
        let (ch, framed) = net::connect_direct_framed(&addr, &o).await?;
        anyhow::ensure!(framed, "the actor process does not speak control frames");
        anyhow::Ok(ActorServiceClient::new(ch))
    })?;
    let inside = if o.tls_ca.is_some() {
        " inside TLS"
    } else {
        ""
    };
    println!(
        "chunk size {} KiB, {reps} repetitions per size, medians{}",
        chunk >> 10,
        if inside.is_empty() {
            ""
        } else {
            "; the gRPC stream and the frames inside TLS, the raw copy plain"
        }
    );

    let mut put = |b: &DataBatch, sum: u64, path: Path| -> Result<f64> {
        rt.block_on(async {
            let t = Instant::now();
            let r = if path == Path::Shared {
                let f = SharedFile::write(b)?;
                client.put_batch(tokio_stream::iter([f.chunk()])).await?
            } else if path == Path::Framed {
                let mut req = tonic::Request::new(tokio_stream::empty());
                req.extensions_mut().insert(FramedBatch(b.clone()));
                direct.put_batch(req).await?
            } else if chunk == batch::CHUNK_BYTES {
                client.put_batch(rlhf_runtime::batch_stream(b)?).await?
            } else {
                let chunks = batch::encode_chunks(b, chunk)?;
                client.put_batch(tokio_stream::iter(chunks)).await?
            }
            .into_inner();
            let s = t.elapsed().as_secs_f64();
            anyhow::ensure!(r.checksum == sum, "checksum mismatch: data corrupted");
            anyhow::ensure!(r.rows == b.len()? as u64, "row count mismatch");
            anyhow::Ok(s)
        })
    };
    // Warm up the connection, the actor's allocator and both paths.
    let warm = make_batch(8)?;
    for path in [Path::Streamed, Path::Shared, Path::Framed] {
        put(&warm, batch::checksum(&warm), path)?;
    }

    for mib in sizes {
        let b = make_batch(mib)?;
        let sum = batch::checksum(&b);
        let wire = batch::encode(&b)?;
        let bytes = wire.len();
        raw_link.copy(&wire, false)?;
        anyhow::ensure!(
            raw_link.copy(&wire, true)?.1 == sum,
            "the raw copy's receiver saw another batch"
        );

        // In-process stages, for where the time goes.
        let t = Instant::now();
        let chunks = batch::encode_chunks(&b, chunk)?;
        let enc_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut asm = batch::Assembler::new(u64::MAX);
        for ch in chunks {
            asm.push(ch)?;
        }
        let (back, back_sum) = asm.finish_with_checksum()?;
        let asm_s = t.elapsed().as_secs_f64();
        anyhow::ensure!(
            back_sum == sum && back == b,
            "in-process round trip differs"
        );
        drop(back);
        let t = Instant::now();
        let file = SharedFile::write(&b)?;
        let write_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mapped = rlhf_runtime::shared_batch::open(&file.chunk(), u64::MAX)?
            .map_err(|u| anyhow::anyhow!("{u}"))?;
        let open_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        anyhow::ensure!(batch::checksum(&mapped) == sum, "shared round trip differs");
        let sum_s = t.elapsed().as_secs_f64();
        drop((file, mapped));

        let mut memcpy_dst = vec![0u8; bytes];
        let (mut raw, mut grpc, mut memcpy, mut shm) = (vec![], vec![], vec![], vec![]);
        let (mut framed, mut raw_checked) = (vec![], vec![]);
        let (mut raw_cpu, mut client_cpu, mut actor_cpu) = (0.0, 0.0, 0.0);
        for rep in 0..reps {
            let r0 = cpu_seconds(std::process::id())? + cpu_seconds(actor_pid)?;
            raw.push(raw_link.copy(&wire, false)?.0);
            raw_cpu += cpu_seconds(std::process::id())? + cpu_seconds(actor_pid)? - r0;
            let (c0, a0) = (cpu_seconds(std::process::id())?, cpu_seconds(actor_pid)?);
            grpc.push(put(&b, sum, Path::Streamed)?);
            client_cpu += cpu_seconds(std::process::id())? - c0;
            actor_cpu += cpu_seconds(actor_pid)? - a0;
            let t = Instant::now();
            memcpy_dst.copy_from_slice(&wire);
            std::hint::black_box(&memcpy_dst);
            memcpy.push(t.elapsed().as_secs_f64());
            shm.push(put(&b, sum, Path::Shared)?);
            // The frames and the copy doing the same work take turns going first.
            if rep % 2 == 0 {
                framed.push(put(&b, sum, Path::Framed)?);
                raw_checked.push(raw_link.copy(&wire, true)?.0);
            } else {
                raw_checked.push(raw_link.copy(&wire, true)?.0);
                framed.push(put(&b, sum, Path::Framed)?);
            }
        }
        let (raw_m, grpc_m) = (median(&mut raw), median(&mut grpc));
        let (memcpy_m, shm_m) = (median(&mut memcpy), median(&mut shm));
        let (framed_m, checked_m) = (median(&mut framed), median(&mut raw_checked));
        let gbps = |s: f64| bytes as f64 / s / 1e9;
        let verdict = |r: f64, goal: f64| if r >= goal { "met" } else { "NOT met" };
        println!("batch {mib} MiB ({bytes} bytes) to the actor process, medians of {reps}:");
        println!(
            "  streamed over gRPC{inside} {:8.1} ms {:6.2} GB/s; tuned raw TCP copy between the processes {:8.1} ms {:6.2} GB/s; ratio {:.2} (goal >= 0.9: {})",
            grpc_m * 1e3,
            gbps(grpc_m),
            raw_m * 1e3,
            gbps(raw_m),
            raw_m / grpc_m,
            verdict(raw_m / grpc_m, 0.9)
        );
        println!(
            "  raw control frames{inside} {:8.1} ms {:6.2} GB/s; tuned raw TCP copy between the processes {:8.1} ms {:6.2} GB/s; ratio {:.2} (goal >= 0.9: {}); {:.2}x the gRPC stream's speed",
            framed_m * 1e3,
            gbps(framed_m),
            raw_m * 1e3,
            gbps(raw_m),
            raw_m / framed_m,
            verdict(raw_m / framed_m, 0.9),
            grpc_m / framed_m
        );
        println!(
            "  the same raw copy, then viewed and checksummed by the receiver as the actor does {:8.1} ms {:6.2} GB/s; frames' ratio to it {:.2}",
            checked_m * 1e3,
            gbps(checked_m),
            checked_m / framed_m
        );
        println!(
            "  shared memory      {:8.1} ms {:6.2} GB/s; memcpy in one process {:8.1} ms {:6.2} GB/s; ratio {:.2} (goal >= 0.5: {})",
            shm_m * 1e3,
            gbps(shm_m),
            memcpy_m * 1e3,
            gbps(memcpy_m),
            memcpy_m / shm_m,
            verdict(memcpy_m / shm_m, 0.5)
        );
        println!(
            "  cpu per transfer over gRPC: sender {:.0} ms + actor {:.0} ms (raw copy, both sides: {:.0} ms); in process: encode_chunks {:.2} ms, assemble + decode + checksum {:.1} ms ({:.2} GB/s)",
            client_cpu / reps as f64 * 1e3,
            actor_cpu / reps as f64 * 1e3,
            raw_cpu / reps as f64 * 1e3,
            enc_s * 1e3,
            asm_s * 1e3,
            gbps(asm_s)
        );
        println!(
            "  shared memory in process: write {:.1} ms, open + claim {:.1} ms, checksum {:.1} ms",
            write_s * 1e3,
            open_s * 1e3,
            sum_s * 1e3
        );
    }
    Ok(())
}
