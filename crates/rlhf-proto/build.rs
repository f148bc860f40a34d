//! Compiles proto/ with protox (pure Rust), so no system protoc is needed.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        "common.proto",
        "head.proto",
        "worker.proto",
        "actor.proto",
        "role.proto",
    ]
    .map(|f| root.join("rlhf/v1").join(f));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&root])?;
    // Batch chunks as `Bytes`: decoding slices them out of tonic's buffer instead of
    // copying, and encoders hand out views of tensor storage.
    tonic_prost_build::configure()
        .bytes(".rlhf.v1.BatchChunk.data")
        .compile_fds(fds)?;
    Ok(())
}
