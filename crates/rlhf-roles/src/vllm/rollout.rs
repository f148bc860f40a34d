//! A rollout rank's vLLM engine (`actor_rollout.engine: vllm`): the rank's [`VllmServer`]
//! started from its `RoleSpec` with its worker's vLLM Python, generation and teacher-forced
//! log-probs through it, and the weights of each sync published to it (the rank's received
//! copy written as safetensors into the server's shared-memory directory, reloaded in place,
//! then proved by the log-probs of a fixed probe sequence against the received copy's).
//!
//! A server that dies is a failure of the role process: it exits, so that the driver sees a
//! dead role and `fault_tolerance` restarts the job as after any other death, instead of
//! every later call failing one by one against a server that is gone.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use rlhf_config::{RoleSpec, Shapes, VllmOptions};
use rlhf_core::calls::{LogProbsRequest, LogProbsResponse, Mat};
use rlhf_core::DeviceSpec;
use rlhf_model::{Batch, Generation, GenerationConfig, Model};
use rlhf_types::DType;

use super::{VllmDevice, VllmServer, VllmSettings};
use crate::error::{Error, Result};

/// Exit status of a role process whose vLLM server died (EX_SOFTWARE).
const EXIT_VLLM_DIED: i32 = 70;
/// Tokens of the probe sequence run after each reload.
const PROBE_LEN: usize = 24;

/// What publishing one sync's weights to vLLM did.
#[derive(Debug, Clone, Copy)]
pub struct Published {
    /// Writing the safetensors into the server's directory.
    pub write: Duration,
    /// vLLM's pause, reload and resume.
    pub reload: Duration,
    /// Largest |log-prob| difference on the probe sequence, vLLM against the received copy.
    pub probe_gap: f32,
    pub bytes: u64,
}

/// One rollout rank's vLLM server.
pub struct VllmRollout {
    server: Mutex<VllmServer>,
    label: String,
    /// Largest probe gap accepted after a reload (the dtype's rounding, with room).
    probe_tolerance: f32,
    probe: Vec<u32>,
}

impl VllmRollout {
    /// Starts the server of `spec`'s rank for the model in its `model_dir` (`model` is the
    /// rank's candle copy, for the vocabulary). Call on the role's compute thread (see
    /// [`VllmServer::start`]).
    pub fn start(spec: &RoleSpec, opts: &VllmOptions, model: &Model) -> Result<Self> {
        let label = spec.slot.label();
        let python = std::env::var_os(rlhf_runtime::worker::vllm::VLLM_PYTHON_ENV)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{label}: actor_rollout.engine=vllm, but this role's worker has no vLLM \
                     Python; start `rlhf-worker join` with --vllm-python PATH (or \
                     RLHF_VLLM_PYTHON=PATH), PATH an interpreter with vLLM installed"
                ))
            })?;
        let device = match spec.device {
            DeviceSpec::Cpu => VllmDevice::Cpu,
            DeviceSpec::Cuda { .. } => VllmDevice::Cuda,
            other => {
                return Err(Error::invalid(format!(
                    "{label}: actor_rollout.engine=vllm runs on CPUs and CUDA GPUs, not {other}; \
                     use actor_rollout.engine=candle"
                )))
            }
        };
        let (dtype, probe_tolerance) = match spec.dtype {
            DType::F32 => ("float32", 1e-3),
            DType::BF16 => ("bfloat16", 0.25),
            DType::F16 => ("float16", 0.1),
            other => {
                return Err(Error::invalid(format!(
                    "{label}: vLLM does not serve weights of dtype {other:?}"
                )))
            }
        };
        let vocab = model.config().vocab_size;
        let settings = VllmSettings {
            python: python.into(),
            model_dir: spec.model_dir()?.to_path_buf(),
            device,
            dtype: dtype.into(),
            max_model_len: spec.shapes.seq_len(),
            kv_cache_gb: opts.kv_cache_gb,
            gpu_memory_utilization: opts.gpu_memory_utilization,
            max_num_seqs: opts.max_num_seqs as usize,
            enable_prefix_caching: opts.enable_prefix_caching,
            extra_args: opts.extra_args.clone(),
            start_timeout: Duration::from_secs_f64(opts.start_timeout_s),
            request_timeout: Duration::from_secs_f64(opts.request_timeout_s),
            vocab_size: vocab,
        };
        let t = Instant::now();
        let server = VllmServer::start(&settings).map_err(|e| {
            e.context(format!(
                "{label}: starting its vLLM server (actor_rollout.engine=vllm, {})",
                settings.python.display()
            ))
        })?;
        tracing::info!(
            "{label}: vLLM server (pid {}) serves {} after {:.1} s",
            server.pid(),
            settings.model_dir.display(),
            t.elapsed().as_secs_f64()
        );
        // A fixed sequence spread over the vocabulary, the same on every rank and step.
        let probe = (0..PROBE_LEN.min(spec.shapes.seq_len()).max(2))
            .map(|i| ((i as u64 * 7919 + 13) % vocab.max(1) as u64) as u32)
            .collect();
        Ok(Self {
            server: Mutex::new(server),
            label,
            probe_tolerance,
            probe,
        })
    }

    fn lock(&self) -> MutexGuard<'_, VllmServer> {
        self.server.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `e`, unless the server died: then the role process ends (see the module header).
    /// Its health decides, not whether its process is gone yet: a killed server's socket
    /// closes while it is still exiting, and a dead engine can sit behind a live API server.
    fn checked(&self, server: &mut VllmServer, e: Error) -> Error {
        if !server.is_running() || !server.healthy() {
            eprintln!(
                "error: {}: its vLLM server died: {e}; the role process exits so that the job \
                 fails over (fault_tolerance restarts it)",
                self.label
            );
            server.stop();
            std::process::exit(EXIT_VLLM_DIED);
        }
        e.context(format!("{}: vLLM", self.label))
    }

    /// Generates with the served weights (see [`VllmServer::generate`]).
    pub fn generate(&self, prompts: &[Vec<u32>], gen: &GenerationConfig) -> Result<Generation> {
        let mut s = self.lock();
        match s.generate(prompts, gen) {
            Ok(g) => Ok(g),
            Err(e) => Err(self.checked(&mut s, e)),
        }
    }

    /// Teacher-forced log-probs `[rows][len - 1]` of whole sequences, at temperature 1.
    pub fn sequence_log_probs(&self, seqs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let mut s = self.lock();
        match s.sequence_log_probs(seqs) {
            Ok(v) => Ok(v),
            Err(e) => Err(self.checked(&mut s, e)),
        }
    }

    /// The served model's log-probs of a request's response tokens (teacher-forced, at
    /// temperature 1: vLLM's prompt log-probs know no other), `[rows, R]`, 0 where the
    /// response mask is. vLLM gives no entropy: that matrix is zeros (only the log-probs of
    /// a rollout rank are read, for the `training/rollout_logprob_gap_*` of async runs).
    pub fn response_log_probs(
        &self,
        req: &LogProbsRequest,
        shapes: Shapes,
    ) -> Result<LogProbsResponse> {
        let seq = &req.0;
        let (p, r) = (shapes.prompt_len, shapes.response_len);
        if seq.input_ids.cols != p + r || seq.attention_mask.shape() != seq.input_ids.shape() {
            return Err(Error::invalid(format!(
                "ComputeLogProbs: sequences of shape {:?}, expected [rows, {}] \
                 (actor_rollout.max_prompt_length + max_response_length)",
                seq.input_ids.shape(),
                p + r
            )));
        }
        let rows = seq.input_ids.rows;
        // Each row without its padding, and where its response starts in it.
        let mut seqs = Vec::with_capacity(rows);
        let mut starts = Vec::with_capacity(rows);
        for i in 0..rows {
            let (ids, mask) = (seq.input_ids.row(i), seq.attention_mask.row(i));
            let mut row = Vec::with_capacity(p + r);
            for j in 0..p + r {
                if mask[j] != 0 {
                    if j == p {
                        starts.push(row.len());
                    }
                    row.push(u32::try_from(ids[j]).map_err(|_| {
                        Error::invalid(format!(
                            "ComputeLogProbs: row {i} column {j} holds {}, which is no token id",
                            ids[j]
                        ))
                    })?);
                }
            }
            if starts.len() == i {
                starts.push(row.len());
            }
            seqs.push(row);
        }
        let lps = self.sequence_log_probs(&seqs)?;
        let mut out = Mat::filled(rows, r, 0.0f32);
        for i in 0..rows {
            let mask = &seq.attention_mask.row(i)[p..];
            let mut k = starts[i];
            for (t, &m) in mask.iter().enumerate() {
                if m != 0 {
                    // The log-prob of token k of the row is entry k - 1.
                    out.row_mut(i)[t] = k
                        .checked_sub(1)
                        .and_then(|x| lps[i].get(x).copied())
                        .unwrap_or(0.0);
                    k += 1;
                }
            }
        }
        Ok(LogProbsResponse {
            entropy: Mat::filled(rows, r, 0.0),
            log_probs: out,
        })
    }

    /// Serves `model`'s weights (a LoRA model's merged into its base): written as
    /// safetensors into the server's private directory, reloaded, then checked with the
    /// probe sequence. The files are removed after the reload (they sit in shared memory).
    pub fn publish(&self, model: &Model) -> Result<Published> {
        let label = &self.label;
        let mut s = self.lock();
        let dir = s.weights_dir();
        let t = Instant::now();
        let image = if model.lora().is_some() {
            model.merged_image(None)?
        } else {
            model.image(None)?
        };
        let _ = std::fs::remove_dir_all(&dir);
        image.write(&dir).map_err(|e| {
            Error::from(e).context(format!(
                "{label}: writing the weights for vLLM into {}",
                dir.display()
            ))
        })?;
        let bytes = dir_bytes(&dir);
        let write = t.elapsed();
        let reloaded = s.reload(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let reload = match reloaded {
            Ok(d) => d,
            Err(e) => return Err(self.checked(&mut s, e)),
        };
        let served = match s.sequence_log_probs(std::slice::from_ref(&self.probe)) {
            Ok(mut v) => v.pop().unwrap_or_default(),
            Err(e) => return Err(self.checked(&mut s, e)),
        };
        let ours = probe_log_probs(model, &self.probe)?;
        // A NaN on either side counts as the largest gap (f32::max would skip it).
        let probe_gap = served
            .iter()
            .zip(&ours)
            .map(|(a, b)| (a - b).abs())
            .map(|d| if d.is_nan() { f32::INFINITY } else { d })
            .fold(0.0f32, f32::max);
        if served.len() != ours.len() || probe_gap > self.probe_tolerance {
            return Err(Error::internal(format!(
                "{label}: after the reload, vLLM's log-probs of the probe sequence differ from \
                 the received weights' by up to {probe_gap:.3e} (tolerance {:.1e}, {} vs {} \
                 positions): vLLM does not serve the trainer's weights (a model whose weight \
                 names or layout vLLM reads otherwise?)",
                self.probe_tolerance,
                served.len(),
                ours.len()
            )));
        }
        Ok(Published {
            write,
            reload,
            probe_gap,
            bytes,
        })
    }
}

/// Bytes of the files in `dir`.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// `model`'s teacher-forced log-probs of `ids[1..]` at temperature 1.
fn probe_log_probs(model: &Model, ids: &[u32]) -> Result<Vec<f32>> {
    let n = ids.len();
    let t = Tensor::from_vec(ids.to_vec(), (1, n), model.device())?;
    let mask = Tensor::ones((1, n), candle_core::DType::U32, model.device())?;
    let batch = Batch::from_mask(t, mask)?;
    let (lp, _) = model.log_probs_and_entropy(&batch, 1.0, false)?;
    let row = lp
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    // Entry j is the log-prob of ids[j + 1].
    Ok(row.into_iter().take(n - 1).collect())
}
