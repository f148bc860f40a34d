//! `rlhf-head check`: a job's plan before it runs: the per-role and per-phase memory, the
//! fit on the configured pool or on a running cluster's free resources, and the files the
//! run would read (dataset, models, tokenizer), with the Hugging Face cache consulted
//! without downloading.

use std::path::Path;
use std::time::Duration;

use rlhf_config::{PpoConfig, RoleKind};
use rlhf_core::{Error, Result};
use rlhf_proto::v1 as pb;

use crate::run_cmd::{devices_needed, load_config, JobConfigArgs};
use crate::Connect;

#[derive(clap::Args, Clone)]
pub(crate) struct CheckArgs {
    #[command(flatten)]
    pub(crate) config: JobConfigArgs,
    /// Also print the resolved config (the sections this job's trainer uses).
    #[arg(long)]
    pub(crate) show_config: bool,
    /// Also check the fit against this running cluster's free resources.
    #[arg(long)]
    pub(crate) address: Option<String>,
    /// The collective backend the job will run with (`rlhf-head run --comm-backend`): with
    /// nccl the estimate adds NCCL's own device memory per communicator.
    #[arg(long)]
    pub(crate) comm_backend: Option<rlhf_core::CommBackend>,
}

pub(crate) async fn check(args: CheckArgs) -> Result<()> {
    let cfg = load_config(&args.config)?;
    let nodes: Vec<(String, std::collections::BTreeMap<String, f64>)> = match &args.address {
        Some(a) => {
            let conn = Connect {
                address: Some(a.clone()),
                token_file: None,
                tls_ca: None,
                connect_timeout: Duration::from_secs(10),
                state_dir: None,
            };
            let mut c = crate::client(&conn).await?;
            let s = c
                .cluster_status(pb::ClusterStatusRequest {})
                .await
                .map_err(Error::from)?
                .into_inner();
            let rejoining = s
                .nodes
                .iter()
                .filter(|n| n.state == pb::NodeState::Rejoining as i32)
                .count();
            if rejoining > 0 {
                println!(
                    "note: {rejoining} node(s) have not registered again since the head restarted and are left out; check again once `rlhf-head status` lists them ALIVE\n"
                );
            }
            s.nodes
                .iter()
                .filter(|n| n.state == pb::NodeState::Alive as i32)
                .map(|n| {
                    (
                        n.hostname.clone(),
                        n.available
                            .clone()
                            .unwrap_or_default()
                            .amounts
                            .into_iter()
                            .collect(),
                    )
                })
                .collect()
        }
        None => {
            // No cluster named: check against one node that has exactly what the pool asks.
            let r = cfg.resource_pool.device.resource().to_string();
            vec![(
                "(the pool as configured)".to_string(),
                [(r, devices_needed(&cfg))].into_iter().collect(),
            )]
        }
    };
    let collectives = match args.comm_backend {
        Some(rlhf_core::CommBackend::Nccl) => rlhf_config::Collectives::Nccl,
        Some(rlhf_core::CommBackend::Tcp | rlhf_core::CommBackend::Shm) | None => {
            rlhf_config::Collectives::Host
        }
    };
    print!(
        "{}",
        cfg.check_report_with(&nodes, args.show_config, collectives)
    );
    let (missing, hub) = missing_files(&cfg);
    println!("\n# files the run reads");
    if missing.is_empty() && hub.is_empty() {
        println!("all present (data, models, tokenizer)");
    }
    for m in &missing {
        println!("missing: {m}");
    }
    for h in &hub {
        println!("hub: {h}");
    }
    Ok(())
}

/// What `run` would fail to read from this machine: the dataset, each role's model
/// directory, the tokenizer, the fixed responses. `check` lists them instead of failing (a
/// plan for a cluster whose nodes hold the models is still worth seeing). Models named by a
/// Hugging Face repo id are looked up in this machine's HF cache without downloading: the
/// second list says, per id, whether it is cached or will be downloaded when the run starts
/// (each node resolves through its own cache); offline, an uncached id is missing.
fn missing_files(cfg: &PpoConfig) -> (Vec<String>, Vec<String>) {
    let mut out = Vec::new();
    let hub = rlhf_hub::Hub::from_env();
    // (spec, what is needed, the keys that name it), one entry per spec and need.
    let mut ids: Vec<(String, rlhf_hub::Need, Vec<String>)> = Vec::new();
    let mut by_id = |spec: &str, need: rlhf_hub::Need, key: String| match ids
        .iter_mut()
        .find(|(s, n, _)| s == spec && *n == need)
    {
        Some((_, _, keys)) => keys.push(key),
        None => ids.push((spec.to_string(), need, vec![key])),
    };
    if !Path::new(&cfg.data.path).is_file() {
        out.push(format!("data.path {} is not a file", cfg.data.path));
    }
    if let Some(p) = cfg.data.eval_path.as_deref().filter(|p| !p.is_empty()) {
        if !Path::new(p).is_file() {
            out.push(format!("data.eval_path {p} is not a file"));
        }
    }
    for role in RoleKind::ALL {
        if cfg.role_enabled(role) && cfg.role_model(role).is_some() {
            match rlhf_config::spec::model_dir(cfg, role) {
                Err(e) => out.push(e.to_string()),
                Ok(dir) => {
                    if let Some(id) = hub_id(&dir) {
                        by_id(id, rlhf_hub::Need::Model, format!("{role}.model"));
                    }
                }
            }
        }
    }
    let actor = rlhf_config::spec::model_dir(cfg, RoleKind::ActorRollout).ok();
    if let Some(t) = rlhf_config::spec::tokenizer_dir(cfg, actor.as_deref()) {
        if let Some(id) = hub_id(&t) {
            by_id(id, rlhf_hub::Need::Tokenizer, "tokenizer".into());
        } else if !t.join("tokenizer.json").is_file() {
            out.push(format!(
                "tokenizer: {} has no tokenizer.json (training.tokenizer_name_or_path)",
                t.display()
            ));
        }
    }
    if let Some(f) = cfg
        .actor_rollout
        .fixed_responses_file
        .as_deref()
        .filter(|f| !f.is_empty())
    {
        if !Path::new(f).is_file() {
            out.push(format!(
                "actor_rollout.fixed_responses_file {f} is not a file"
            ));
        }
    }
    let mut notes = Vec::new();
    let cwd = std::env::current_dir().unwrap_or_else(|_| ".".into());
    for (spec, need, keys) in ids {
        let keys = keys.join(", ");
        let also = meant_local(&spec, &cwd);
        match hub.locate(&spec, need) {
            Ok(rlhf_hub::Located::Cached { dir, .. }) => notes.push(format!(
                "{keys}: {spec} is in this machine's Hugging Face cache ({})",
                dir.display()
            )),
            Ok(rlhf_hub::Located::NotCached { cache, why, .. }) if hub.is_online() => {
                notes.push(format!(
                    "{keys}: {spec} is not in this machine's Hugging Face cache at {} ({why}); \
                     each role process downloads it from {} into its node's cache when the \
                     run starts{also}",
                    cache.display(),
                    hub.endpoint()
                ))
            }
            Ok(rlhf_hub::Located::NotCached { repo, cache, why }) => {
                let e = rlhf_hub::Error::NotCached {
                    repo: Box::new(repo),
                    cache,
                    why,
                    download_error: None,
                };
                out.push(format!("{keys}: {e}{also}"));
            }
            Ok(rlhf_hub::Located::Directory(_)) => {}
            Err(e) => out.push(format!("{keys}: {e}{also}")),
        }
    }
    (out, notes)
}

/// The Hub repo id a model or tokenizer path is, when it is one (and no such directory
/// exists here).
/// For a model named like a repo id whose first part is a directory under `base` (the
/// working directory: `models/Qwen2.5-7B-Instruct` with a `models/` folder): the words that
/// say it may be meant as that local directory, which is missing. Empty otherwise.
fn meant_local(spec: &str, base: &Path) -> String {
    let Some((first, _)) = spec.split_once('/') else {
        return String::new();
    };
    if !base.join(first).is_dir() {
        return String::new();
    }
    format!(
        "; if a local directory was meant: {spec} does not exist (relative to {}), though {first}/ does; put the model's HF files there",
        base.display()
    )
}

fn hub_id(path: &Path) -> Option<&str> {
    path.to_str()
        .filter(|s| rlhf_config::spec::is_repo_id_not_dir(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `models/X` with a `models/` folder but no `models/X`: the hub note also says the local
    /// directory is missing; a plain repo id (no such folder) gets no such words.
    #[test]
    fn a_repo_id_shaped_model_under_an_existing_folder_is_said_to_be_missing_locally() {
        let base = tempfile::tempdir().unwrap();
        std::fs::create_dir(base.path().join("models")).unwrap();
        let said = meant_local("models/Qwen2.5-7B-Instruct", base.path());
        assert!(
            said.contains("models/Qwen2.5-7B-Instruct does not exist")
                && said.contains(&base.path().display().to_string()),
            "{said}"
        );
        assert_eq!(meant_local("Qwen/Qwen2.5-7B-Instruct", base.path()), "");
        assert_eq!(meant_local("gpt2", base.path()), "");
    }
}
