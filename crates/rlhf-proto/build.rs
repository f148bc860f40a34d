//! Compiles proto/ with protox (pure Rust), so no system protoc is needed.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time: a build-script binary compiled for one checkout is reused for another
    // that shares the target directory, so a compile-time path would compile the wrong protos.
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = [
        "common.proto",
        "head.proto",
        "worker.proto",
        "actor.proto",
        "role.proto",
        "control.proto",
    ]
    .map(|f| root.join("rlhf/v1").join(f));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&root])?;
    // Every unary method's gRPC path: the calls that control frames may carry (a streaming
    // call keeps HTTP/2).
    let mut unary = Vec::new();
    for file in &fds.file {
        for service in &file.service {
            for m in &service.method {
                if !m.client_streaming() && !m.server_streaming() {
                    unary.push(format!(
                        "/{}.{}/{}",
                        file.package(),
                        service.name(),
                        m.name()
                    ));
                }
            }
        }
    }
    unary.sort();
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("unary_methods.rs");
    std::fs::write(
        out,
        format!(
            "/// The gRPC path of every unary method of proto/, sorted.\npub const UNARY_METHODS: &[&str] = &{unary:?};\n"
        ),
    )?;
    // Batch chunks as `Bytes`: decoding slices them out of tonic's buffer instead of
    // copying, and encoders hand out views of tensor storage.
    tonic_prost_build::configure()
        .bytes(".rlhf.v1.BatchChunk.data")
        .bytes(".rlhf.v1.SnapshotChunk.data")
        .bytes(".rlhf.v1.ControlRequest.body")
        .bytes(".rlhf.v1.ControlResponse.body")
        .compile_fds(fds)?;
    Ok(())
}
