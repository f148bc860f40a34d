//! Writes the config key reference to `configs/README.md`:
//! `cargo run -p rlhf-config --example gen_config_docs`.

use std::path::Path;

fn main() -> std::io::Result<()> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/README.md");
    std::fs::write(&path, rlhf_config::docs::config_reference_markdown())?;
    println!("wrote {}", path.display());
    Ok(())
}
