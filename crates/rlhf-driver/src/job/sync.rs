//! Weight sync trainer -> rollout and checkpoints, for the loop.

use std::path::PathBuf;

use rlhf_core::CommGroup;
use rlhf_core::Error;
use rlhf_proto::v1 as pb;

use crate::checkpoint::{self, TrainerState};
use crate::group::WorkerGroup;

use super::algorithm::Algorithm;
use super::{timed, Failed, Loop, Res};

impl Loop<'_> {
    /// Broadcasts the trainer's weights to the rollout ranks and checks that every rank
    /// ends with the trainer's checksum.
    pub(super) async fn sync_weights(&self, version: u64) -> Res<f64> {
        if self.roles.colocated {
            // The rollout ranks generate with the trainers' own weights: nothing to move.
            return Ok(0.0);
        }
        let g = self.roles.weights_group();
        let (answers, secs) = timed(g.unary(
            self.opts.call_timeout,
            "SyncWeights",
            |_, mut c| async move {
                c.sync_weights(pb::SyncWeightsRequest {
                    group: pb::CommGroup::from(CommGroup::Weights) as i32,
                    version,
                    bucket_bytes: 0,
                })
                .await
            },
        ))
        .await;
        let answers = answers?;
        if let Some(first) = answers.first() {
            for (rank, a) in answers.iter().enumerate().skip(1) {
                if a.checksum != first.checksum {
                    return Err(Failed::Other(Error::internal(format!(
                        "weight sync at version {version}: rollout rank {} has checksum {:016x}, the trainer {:016x}",
                        rank - 1,
                        a.checksum,
                        first.checksum
                    ))));
                }
            }
        }
        Ok(secs)
    }

    pub(super) async fn save<A: Algorithm>(&self, step: u64, algo: &A) -> Res<PathBuf> {
        let dir = checkpoint::step_dir(self.ckpt_root, step);
        let t = self.opts.call_timeout;
        let actor_dir = dir.join("actor").to_string_lossy().into_owned();
        let critic_dir = dir.join("critic").to_string_lossy().into_owned();
        let first = |g: &WorkerGroup| WorkerGroup {
            id: g.id,
            members: g.members.iter().take(1).cloned().collect(),
        };
        let (train0, critic0) = (first(&self.roles.train), first(&self.roles.critic));
        let (_, _) = tokio::try_join!(
            train0.unary(t, "SaveCheckpoint", |_, mut c| {
                let d = actor_dir.clone();
                async move {
                    c.save_checkpoint(pb::SaveCheckpointRequest { dir: d })
                        .await
                }
            }),
            critic0.unary(t, "SaveCheckpoint", |_, mut c| {
                let d = critic_dir.clone();
                async move {
                    c.save_checkpoint(pb::SaveCheckpointRequest { dir: d })
                        .await
                }
            }),
        )?;
        let sums = |g: WorkerGroup| async move {
            g.unary(t, "WeightsChecksum", |_, mut c| async move {
                c.weights_checksum(pb::WeightsChecksumRequest {}).await
            })
            .await
        };
        let (a, c) = tokio::try_join!(sums(train0), sums(critic0))?;
        let mut state = TrainerState::new(
            A::NAME,
            step,
            self.sampler.cursor(),
            self.cfg.training.seed,
            &self.opts.job_id,
        );
        algo.save(&mut state);
        state.actor_checksum = a.first().map(|x| x.checksum).unwrap_or(0);
        state.critic_checksum = c.first().map(|x| x.checksum);
        let dir = checkpoint::commit(self.ckpt_root, &state)?;
        checkpoint::prune(self.ckpt_root, self.cfg.checkpoint.keep_last)?;
        Ok(dir)
    }
}
