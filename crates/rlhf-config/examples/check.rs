//! Prints what `rlhf-head check` will print, for a config and a made-up
//! cluster: `cargo run -p rlhf-config --example check -- ppo_llama32_1b 8,8 [key=value ...]`
//! (the second argument is the device count of each node, of the config's
//! device kind).

use std::collections::BTreeMap;
use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "ppo_tiny".into());
    let nodes_arg = args.next().unwrap_or_else(|| "8".into());
    let overrides: Vec<String> = args.collect();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let cfg = rlhf_config::load(&dir, &name, &overrides)?;
    let resource = cfg.resource_pool.device.resource().to_string();
    let mut nodes = Vec::new();
    for (i, n) in nodes_arg.split(',').enumerate() {
        let count: f64 = n.trim().parse()?;
        nodes.push((
            format!("node{i}"),
            BTreeMap::from([(resource.clone(), count)]),
        ));
    }
    print!("{}", cfg.check_report(&nodes, true));
    Ok(())
}
