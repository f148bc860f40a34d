//! A trainable engine's checkpoint: an HF model directory (a PEFT adapter directory for a
//! LoRA engine) plus `optimizer.safetensors`,
//! `role_state.json` (scheduler position, weights version) and `manifest.json` (every file's
//! size and content hash). It is written beside the target and moved into place in one
//! rename once every file is on disk (`rlhf_core::durable`), and verified against its
//! manifest before anything is loaded. Saving is two parts: [`capture`] copies the state
//! out on the compute thread, [`Image::write`] writes it, in the background when the driver
//! asks for it (`crate::saves`).
//!
//! A group whose optimizer state is sharded (`training.zero_stage` 1 or 2) saves it in per-rank
//! shards, each rank its own, with no gather: rank 0 writes the directory above with its
//! shard and `optimizer_shards.json` (the world size, every shard's range of the flattened
//! parameters and its file) in place of `optimizer.safetensors`; rank r writes its shard into
//! the sibling directory `DIR.rank-r` (with its own manifest). Any number of ranks, sharded
//! or not, reads them back: each reads the parts of the shards that overlap its own range.

use std::path::Path;

use candle_core::Tensor;
use rlhf_core::durable;
use rlhf_model::Model;
use serde::{Deserialize, Serialize};

use crate::error::{Ctx, Error, Result};
use crate::train::Optim;

/// `role_state.json` of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoleState {
    pub role: rlhf_core::RoleKind,
    /// Optimizer steps taken = the scheduler position.
    pub scheduler_step: u64,
    pub weights_version: u64,
}

pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const ROLE_STATE_FILE: &str = "role_state.json";

pub const OPTIMIZER_SHARDS_FILE: &str = "optimizer_shards.json";

/// A trainable engine's checkpoint captured at one instant ([`capture`]): copies, so another
/// thread can write it ([`Image::write`]) while the engine trains on.
pub struct Image {
    /// The weights (`None` on ranks other than 0 of a sharded group: rank 0 saves them).
    model: Option<rlhf_model::ModelImage>,
    /// A ZeRO-3 model's weights written already: the directory holding the file the image
    /// moves into place, and the weights' checksum ([`crate::spill`]).
    spilled: Option<crate::spill::Spill>,
    optim: OptimImage,
    state: RoleState,
}

/// The optimizer part of an image: the whole state, or this rank's shard.
enum OptimImage {
    Whole(Vec<(String, Tensor)>, usize),
    Shard(Shard),
}

/// One rank's share of a sharded optimizer state.
struct Shard {
    rank: usize,
    world: usize,
    total: usize,
    span: std::ops::Range<usize>,
    step: usize,
    m: Vec<f32>,
    v: Vec<f32>,
}

/// `optimizer_shards.json`: where each rank's share of a sharded optimizer state is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardIndex {
    pub world: usize,
    /// Elements of all the trained parameters laid end to end.
    pub total: usize,
    pub step: usize,
    pub shards: Vec<ShardEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub rank: usize,
    pub start: usize,
    pub end: usize,
    /// The shard's file, relative to the checkpoint's parent directory (the step directory).
    pub file: String,
}

fn shard_file_name(rank: usize, world: usize) -> String {
    format!("optimizer-rank-{rank}-of-{world}.safetensors")
}

/// The directory rank `rank` of a sharded group writes its shard into: `dir` for rank 0,
/// `dir.rank-r` beside it for the others.
pub fn shard_dir(dir: &Path, rank: usize) -> std::path::PathBuf {
    if rank == 0 {
        return dir.to_path_buf();
    }
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".rank-{rank}"));
    dir.with_file_name(name)
}

/// Copies the weights (unless `with_model` is false), the optimizer state (whole, or this
/// rank's shard when it is sharded) and the role state out of the engine. With `dir` (the
/// checkpoint part the image will be written to), a ZeRO-3 model's rank 0 writes the
/// weights beside it as the group gathers them instead of keeping them in memory
/// ([`crate::spill`]).
pub fn capture(
    model: &Model,
    optim: &Optim,
    state: RoleState,
    tokenizer_dir: Option<&Path>,
    dir: Option<&Path>,
) -> Result<Image> {
    let tok = tokenizer_dir.filter(|d| d.join("tokenizer.json").is_file());
    let opt = &optim.opt;
    let (optim, with_model) = match opt.shard() {
        None => {
            let (tensors, step) = opt.state().ctx("copying the optimizer state out")?;
            (OptimImage::Whole(tensors, step), true)
        }
        Some((rank, world)) => {
            let (m, v) = opt.owned_moments().ctx("copying the optimizer shard out")?;
            let shard = Shard {
                rank,
                world,
                total: opt.total_len(),
                span: opt.owned_span(),
                step: opt.steps(),
                m,
                v,
            };
            (OptimImage::Shard(shard), rank == 0)
        }
    };
    // A ZeRO-3 model gathers its weights: every rank takes part, rank 0 keeps them (the
    // others drop each gathered layer at once).
    let mut spilled = None;
    let model = match (model.zero3(), dir) {
        (Some(_), Some(dir)) if with_model && model.lora().is_none() => {
            let (image, spill) = crate::spill::write_model(model, tok, dir)?;
            spilled = Some(spill);
            Some(image)
        }
        _ if with_model => Some(model.image(tok).ctx("copying the weights out")?),
        (Some(z), _) => {
            z.gather_all_for_others()
                .ctx("gathering the weights for rank 0")?;
            None
        }
        (None, _) => None,
    };
    Ok(Image {
        model,
        spilled,
        optim,
        state,
    })
}

impl Image {
    /// The weights' checksum, as [`crate::weights::weights_checksum`] computes it on the
    /// live model at the instant of the capture (0 for a shard without the weights).
    pub fn checksum(&self) -> Result<u64> {
        match (&self.spilled, &self.model) {
            (Some(spill), _) => Ok(spill.checksum()),
            (None, Some(m)) => crate::weights::tensors_checksum(&m.tensors),
            (None, None) => Ok(0),
        }
    }

    /// The directory [`Image::write`] fills for the part directory `dir`: `dir` itself, or
    /// [`shard_dir`] for a shard of rank r > 0.
    pub fn target_dir(&self, dir: &Path) -> std::path::PathBuf {
        match &self.optim {
            OptimImage::Shard(sh) => shard_dir(dir, sh.rank),
            OptimImage::Whole(..) => dir.to_path_buf(),
        }
    }

    /// Writes an HF model directory plus the optimizer state and `role_state.json`, beside
    /// `dir` first and then moved into place; returns the files written. A shard of rank
    /// r > 0 goes to [`shard_dir`] instead.
    pub fn write(&self, dir: &Path) -> Result<Vec<String>> {
        let target = self.target_dir(dir);
        let staging = durable::staging_dir(&target);
        if staging.exists() {
            // What an interrupted save left behind.
            std::fs::remove_dir_all(&staging)
                .map_err(|e| Error::internal(format!("removing {}: {e}", staging.display())))?;
        }
        std::fs::create_dir_all(&staging)
            .map_err(|e| Error::internal(format!("creating {}: {e}", staging.display())))?;
        if let Some(model) = &self.model {
            model
                .write(&staging)
                .with_ctx(|| format!("saving the model to {}", staging.display()))?;
        }
        if let Some(spill) = &self.spilled {
            // Its file was moved into the staging directory: nothing is left in it.
            let d = spill.dir();
            std::fs::remove_dir_all(d)
                .map_err(|e| Error::internal(format!("removing {}: {e}", d.display())))?;
        }
        match &self.optim {
            OptimImage::Whole(tensors, step) => {
                rlhf_model::AdamW::write_state(tensors, *step, &staging.join(OPTIMIZER_FILE))
                    .with_ctx(|| format!("saving the optimizer state to {}", staging.display()))?;
            }
            OptimImage::Shard(sh) => write_shard(sh, dir, &staging)?,
        }
        if self.model.is_some() {
            let text = serde_json::to_string_pretty(&self.state)
                .map_err(|e| Error::internal(format!("encoding role_state.json: {e}")))?;
            let path = staging.join(ROLE_STATE_FILE);
            std::fs::write(&path, text + "\n")
                .map_err(|e| Error::internal(format!("writing {}: {e}", path.display())))?;
        }
        let manifest = durable::publish_dir(&target)?;
        let mut files: Vec<String> = manifest.files.into_keys().collect();
        files.push(durable::MANIFEST_FILE.to_string());
        files.sort();
        Ok(files)
    }
}

/// A shard's file into `staging`; rank 0 adds the index of every rank's shard.
fn write_shard(sh: &Shard, dir: &Path, staging: &Path) -> Result<()> {
    let cpu = candle_core::Device::Cpu;
    let n = sh.span.len();
    let tensors: std::collections::HashMap<String, Tensor> = [
        ("exp_avg".to_string(), Tensor::from_slice(&sh.m, n, &cpu)?),
        (
            "exp_avg_sq".to_string(),
            Tensor::from_slice(&sh.v, n, &cpu)?,
        ),
    ]
    .into_iter()
    .collect();
    let path = staging.join(shard_file_name(sh.rank, sh.world));
    candle_core::safetensors::save(&tensors, &path)
        .map_err(|e| Error::internal(format!("writing {}: {e}", path.display())))?;
    if sh.rank != 0 {
        return Ok(());
    }
    let shards = (0..sh.world)
        .map(|r| {
            let span = rlhf_model::shard_span(sh.total, r, sh.world);
            let d = shard_dir(dir, r);
            let name = d.file_name().unwrap_or_default().to_string_lossy();
            ShardEntry {
                rank: r,
                start: span.start,
                end: span.end,
                file: format!("{name}/{}", shard_file_name(r, sh.world)),
            }
        })
        .collect();
    let index = ShardIndex {
        world: sh.world,
        total: sh.total,
        step: sh.step,
        shards,
    };
    let text = serde_json::to_string_pretty(&index)
        .map_err(|e| Error::internal(format!("encoding {OPTIMIZER_SHARDS_FILE}: {e}")))?;
    let path = staging.join(OPTIMIZER_SHARDS_FILE);
    std::fs::write(&path, text + "\n")
        .map_err(|e| Error::internal(format!("writing {}: {e}", path.display())))
}

/// Reads a sharded optimizer state back into `opt`: the parts of every shard that overlap
/// the elements `opt` owns (all of them when it is not sharded), whatever the rank count that
/// wrote them.
fn load_shards(opt: &mut rlhf_model::AdamW, dir: &Path) -> Result<()> {
    let path = dir.join(OPTIMIZER_SHARDS_FILE);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::invalid(format!("cannot read {}: {e}", path.display())))?;
    let index: ShardIndex = serde_json::from_str(&text)
        .map_err(|e| Error::invalid(format!("{} is not a shard index: {e}", path.display())))?;
    if index.total != opt.total_len() {
        return Err(Error::invalid(format!(
            "{}: the optimizer state covers {} parameter elements, this model trains {}; the checkpoint belongs to another model or LoRA setting",
            path.display(),
            index.total,
            opt.total_len()
        )));
    }
    let root = dir.parent().unwrap_or(Path::new("."));
    let want = opt.owned_span();
    let (mut m, mut v) = (vec![0f32; want.len()], vec![0f32; want.len()]);
    let mut covered = 0;
    for e in &index.shards {
        let (a, b) = (e.start.max(want.start), e.end.min(want.end));
        if a >= b {
            continue;
        }
        // Names inside the step directory only: a shard index cannot point a load elsewhere.
        let inside = !e.file.is_empty()
            && Path::new(&e.file)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !inside {
            return Err(Error::invalid(format!(
                "{}: shard file {:?} is not a path inside the checkpoint step directory; the index was not written by a save",
                path.display(),
                e.file
            )));
        }
        let file = root.join(&e.file);
        let shard_dir = file.parent().unwrap_or(root);
        if shard_dir != dir {
            durable::Manifest::verify(shard_dir).with_ctx(|| {
                format!(
                    "the optimizer shard of rank {} ({})",
                    e.rank,
                    file.display()
                )
            })?;
        }
        let tensors = candle_core::safetensors::load(&file, &candle_core::Device::Cpu)
            .map_err(|err| Error::invalid(format!("reading {}: {err}", file.display())))?;
        let get = |name: &str| -> Result<Vec<f32>> {
            let t = tensors.get(name).ok_or_else(|| {
                Error::invalid(format!("{} has no tensor '{name}'", file.display()))
            })?;
            let x = t.flatten_all()?.to_vec1::<f32>()?;
            if x.len() != e.end - e.start {
                return Err(Error::invalid(format!(
                    "{}: '{name}' has {} values for the range {}..{}",
                    file.display(),
                    x.len(),
                    e.start,
                    e.end
                )));
            }
            Ok(x)
        };
        let (sm, sv) = (get("exp_avg")?, get("exp_avg_sq")?);
        let (from, to) = (a - e.start, a - want.start);
        m[to..to + (b - a)].copy_from_slice(&sm[from..from + (b - a)]);
        v[to..to + (b - a)].copy_from_slice(&sv[from..from + (b - a)]);
        covered += b - a;
    }
    if covered != want.len() {
        return Err(Error::invalid(format!(
            "{}: the shards cover {covered} of the {} optimizer elements this rank needs; a shard is missing",
            path.display(),
            want.len()
        )));
    }
    Ok(opt.load_owned_moments(&m, &v, index.step)?)
}

/// Loads weights (into the existing parameters, so the optimizer keeps its variables),
/// the optimizer state and `role_state.json` written by [`save`].
pub fn load(
    model: &Model,
    optim: &mut Optim,
    dir: &Path,
    opts: &rlhf_model::LoadOptions,
) -> Result<RoleState> {
    durable::Manifest::verify(dir)?;
    let path = dir.join(ROLE_STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::invalid(format!(
            "cannot read {}: {e}; LoadCheckpoint needs a directory written by SaveCheckpoint",
            path.display()
        ))
    })?;
    let state: RoleState = serde_json::from_str(&text)
        .map_err(|e| Error::invalid(format!("{} is not a role state: {e}", path.display())))?;
    if model.lora().is_some() {
        // A LoRA engine's checkpoint is its PEFT adapter; the frozen base never changed.
        model
            .load_adapter(dir)
            .with_ctx(|| format!("restoring the adapters from {}", dir.display()))?;
    } else if model.zero3().is_some() {
        // A ZeRO-3 model reads only its pieces of the saved model.
        model
            .load_zero3_weights(dir)
            .with_ctx(|| format!("restoring the weights from {}", dir.display()))?;
    } else {
        let saved = Model::load(dir, opts).with_ctx(|| format!("loading {}", dir.display()))?;
        model
            .set_weights(&saved.named_tensors())
            .with_ctx(|| format!("restoring the weights from {}", dir.display()))?;
    }
    if dir.join(OPTIMIZER_SHARDS_FILE).is_file() {
        load_shards(&mut optim.opt, dir)
            .with_ctx(|| format!("restoring the optimizer shards of {}", dir.display()))?;
    } else {
        optim
            .opt
            .load(&dir.join(OPTIMIZER_FILE))
            .with_ctx(|| format!("restoring the optimizer from {}", dir.display()))?;
    }
    if optim.opt.steps() as u64 != state.scheduler_step {
        return Err(Error::invalid(format!(
            "{}: the optimizer has {} steps but role_state.json says {}; the checkpoint is inconsistent",
            dir.display(),
            optim.opt.steps(),
            state.scheduler_step
        )));
    }
    Ok(state)
}
