//! The async rollout of `actor_rollout.async`: a rollout lane that makes the batches while the
//! loop trains, on a schedule fixed by the config alone, so seeded async runs repeat exactly.
//!
//! The schedule ([`Schedule`]): with staleness k (0 sync, 1 one step off, `max_staleness`
//! bounded) and weights synced after every step that is a multiple of `max(k, 1)`, the batch
//! of step b is sampled with the first synced version at or after `b - 1 - k`. The rollout
//! lane generates batches in order; before a batch that needs newer weights it asks the
//! loop for the sync (the loop does it between its own steps: the only lockstep points) and
//! then, if the next batch was sampled with older weights, runs a teacher-forced log-prob
//! pass of that batch, now on exactly the trainer's weights, for the rollout-vs-trainer gap.
//! Sync mode (k = 0) is the old loop: the lane waits for every sync.

use std::collections::BTreeMap;
use std::time::Duration;

use rlhf_config::AsyncConfig;
use rlhf_core::calls::{LogProbsRequest, Mat, Sequences};
use rlhf_core::{Error, FailureKind};
use tokio::sync::{mpsc, oneshot};

use crate::group::CallError;

use super::rollout::{Probe, Rollout, RolloutSource};
use super::{Failed, Res};

/// Which weights sample which batch, and when weights move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Schedule {
    /// Versions a batch may lag: 0, 1 or `max_staleness`.
    pub staleness: u64,
    /// Steps between syncs.
    pub every: u64,
}

impl Schedule {
    pub fn new(a: &AsyncConfig) -> Self {
        Self {
            staleness: a.staleness(),
            every: a.sync_every(),
        }
    }

    /// The weights version that samples the batch of step `b` (a resumed run samples its
    /// first batches with the checkpoint's weights, which may be newer).
    pub fn version_for(self, b: u64) -> u64 {
        let oldest = b.saturating_sub(1 + self.staleness);
        oldest.div_ceil(self.every) * self.every
    }

    /// Whether the weights after step `s` go to the rollout ranks.
    pub fn is_sync_point(self, s: u64) -> bool {
        s > 0 && s.is_multiple_of(self.every)
    }

    /// Whether the loop syncs the weights after step `s` of a run of `total` steps: the one
    /// rule both lanes follow (a sync the other side does not expect would never happen).
    /// None after the last step: no batch is sampled with those weights.
    pub fn syncs_after(self, s: u64, total: u64) -> bool {
        self.is_sync_point(s) && s < total
    }

    /// The first sync point after version `v`.
    pub fn next_sync_after(self, v: u64) -> u64 {
        (v / self.every + 1) * self.every
    }
}

/// What admission did to one batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Admission {
    pub staleness_mean: f64,
    pub staleness_max: f64,
    pub dropped: usize,
}

/// SkyRL's admission rule at step `step`: a row sampled more than `max_staleness` versions
/// before the trainer's weights (version `step - 1`) is dropped — its response mask is
/// cleared, so it adds nothing to advantages, losses or their means, and the batch keeps its
/// shape (every rank keeps whole micro batches). Fails when no row is left.
pub(super) fn admit(ro: &mut Rollout, step: u64, max_staleness: u64) -> Res<Admission> {
    let Some((_, versions)) = &ro.behaviour else {
        return Ok(Admission {
            staleness_mean: 0.0,
            staleness_max: 0.0,
            dropped: 0,
        });
    };
    let current = step.saturating_sub(1);
    let lag: Vec<u64> = versions
        .iter()
        .map(|&v| current.saturating_sub(v))
        .collect();
    let (mut sum, mut max, mut kept, mut dropped) = (0u64, 0u64, 0usize, 0usize);
    for (row, &l) in lag.iter().enumerate() {
        if l > max_staleness {
            ro.response_mask.row_mut(row).fill(0.0);
            dropped += 1;
        } else {
            sum += l;
            max = max.max(l);
            kept += 1;
        }
    }
    if kept == 0 {
        return Err(Failed::Other(Error::invalid(format!(
            "step {step}: all {dropped} rows were sampled with weights more than actor_rollout.async.max_staleness={max_staleness} versions old (oldest version {}); raise max_staleness or use actor_rollout.async.mode=sync",
            versions.iter().min().copied().unwrap_or(0)
        ))));
    }
    Ok(Admission {
        staleness_mean: sum as f64 / kept as f64,
        staleness_max: max as f64,
        dropped,
    })
}

/// The loop's ends of the lane's channels.
pub(super) struct LoopEnd {
    /// Batches in step order, or the error that stopped the lane.
    pub batches: mpsc::UnboundedReceiver<Res<Rollout>>,
    /// The lane is between batches and needs the weights after this step.
    pub wants: mpsc::UnboundedReceiver<u64>,
    /// The loop synced the weights after this step.
    pub synced: mpsc::UnboundedSender<u64>,
}

impl LoopEnd {
    /// The batch of the next step; the lane's own error when it stopped. The lane's calls
    /// have their own deadlines; `deadline` bounds the wait on top of them.
    pub async fn next_batch(&mut self, step: u64, deadline: Duration) -> Res<Rollout> {
        match tokio::time::timeout(deadline, self.batches.recv()).await {
            Ok(Some(r)) => r,
            Ok(None) => Err(Failed::Other(Error::internal(
                "the rollout lane ended before the last step",
            ))),
            Err(_) => Err(Failed::Other(Error::new(
                FailureKind::Timeout,
                format!(
                    "no batch for step {step} from the rollout lane within {deadline:?}; raise --call-timeout if generation is this slow"
                ),
            ))),
        }
    }

    /// Waits (at most `deadline`) until the lane is between batches and asks for the weights
    /// after `step`.
    pub async fn await_want(&mut self, step: u64, deadline: Duration) -> Res<()> {
        let asked = match tokio::time::timeout(deadline, self.wants.recv()).await {
            Ok(a) => a,
            Err(_) => {
                return Err(Failed::Other(Error::new(
                    FailureKind::Timeout,
                    format!(
                        "the rollout ranks were not free for the weight sync after step {step} within {deadline:?}; raise --call-timeout if generation is this slow"
                    ),
                )))
            }
        };
        match asked {
            Some(s) if s == step => Ok(()),
            Some(s) => Err(Failed::Other(Error::internal(format!(
                "the rollout lane asked for the weights after step {s}, the loop is syncing those after step {step}"
            )))),
            // The lane stopped on an error it queued as its next batch.
            None => match self.batches.try_recv() {
                Ok(Err(e)) => Err(e),
                _ => Err(Failed::Other(Error::internal(
                    "the rollout lane ended while the loop waited to sync",
                ))),
            },
        }
    }
}

/// The lane's ends.
pub(super) struct LaneEnd {
    batches: mpsc::UnboundedSender<Res<Rollout>>,
    wants: mpsc::UnboundedSender<u64>,
    synced: mpsc::UnboundedReceiver<u64>,
}

pub(super) fn channels() -> (LoopEnd, LaneEnd) {
    let (bt, br) = mpsc::unbounded_channel();
    let (wt, wr) = mpsc::unbounded_channel();
    let (st, sr) = mpsc::unbounded_channel();
    (
        LoopEnd {
            batches: br,
            wants: wr,
            synced: st,
        },
        LaneEnd {
            batches: bt,
            wants: wt,
            synced: sr,
        },
    )
}

type ProbeTx = oneshot::Sender<std::result::Result<Mat<f32>, CallError>>;

/// Makes the batches of steps `start + 1 ..= total` on `schedule`, then serves the last
/// syncs' probes. Never returns: the loop drops it when it is done (or failed).
pub(super) async fn rollout_lane(
    src: &mut RolloutSource<'_>,
    schedule: Schedule,
    start: u64,
    total: u64,
    end: LaneEnd,
) {
    lane(src, schedule, start, total, end).await;
    std::future::pending::<()>().await;
}

async fn lane(
    src: &mut RolloutSource<'_>,
    schedule: Schedule,
    start: u64,
    total: u64,
    mut end: LaneEnd,
) {
    // The loop synced the checkpoint's (or the initial) weights as version `start`.
    let mut held = start;
    let mut probes: BTreeMap<u64, (ProbeTx, Sequences)> = BTreeMap::new();
    for b in start + 1..=total {
        while held < schedule.version_for(b) {
            let s = schedule.next_sync_after(held);
            match sync_round(src, &mut end, s, &mut probes).await {
                Some(()) => held = s,
                None => return,
            }
        }
        let mut ro = match src.rollout(b).await {
            Ok(ro) => ro,
            Err(e) => {
                let _ = end.batches.send(Err(e));
                return;
            }
        };
        ro.probe = match &ro.behaviour {
            None => Probe::None,
            Some((_, v)) if v.iter().all(|&v| v + 1 == b) => Probe::Behaviour,
            Some(_) if schedule.syncs_after(b - 1, total) && b - 1 > held => {
                let (tx, rx) = oneshot::channel();
                probes.insert(b, (tx, ro.seq.clone()));
                Probe::Pending(rx)
            }
            Some(_) => Probe::None,
        };
        if end.batches.send(Ok(ro)).is_err() {
            return;
        }
    }
    loop {
        let s = schedule.next_sync_after(held);
        if !schedule.syncs_after(s, total)
            || sync_round(src, &mut end, s, &mut probes).await.is_none()
        {
            return;
        }
        held = s;
    }
}

/// Asks the loop for the weights after step `s`, waits for them, then answers the probe of
/// the batch of step `s + 1`, which the trainers score with exactly these weights.
async fn sync_round(
    src: &RolloutSource<'_>,
    end: &mut LaneEnd,
    s: u64,
    probes: &mut BTreeMap<u64, (ProbeTx, Sequences)>,
) -> Option<()> {
    end.wants.send(s).ok()?;
    let got = end.synced.recv().await?;
    debug_assert_eq!(got, s);
    if let Some((tx, seq)) = probes.remove(&(s + 1)) {
        let r = src
            .roles
            .infer
            .call_split(&LogProbsRequest(seq), src.opts.call_timeout)
            .await
            .map(|r| r.log_probs);
        let _ = tx.send(r);
    }
    // Probes of batches this sync passed over will never be answered.
    probes.retain(|&b, _| b > s + 1);
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlhf_config::AsyncMode;

    fn schedule(mode: AsyncMode, max_staleness: u32) -> Schedule {
        Schedule::new(&AsyncConfig {
            mode,
            max_staleness,
            ..AsyncConfig::default()
        })
    }

    /// Lag of every step's batch and the steps after which weights move, for 12 steps.
    fn lags(s: Schedule) -> (Vec<u64>, Vec<u64>) {
        let lag = (1..=12).map(|b| (b - 1) - s.version_for(b)).collect();
        // Step 12 is the last: nothing syncs after it.
        let syncs = (1..=12).filter(|&x| s.syncs_after(x, 12)).collect();
        (lag, syncs)
    }

    fn batch(versions: &[u64]) -> Rollout {
        let rows = versions.len();
        let seq = Sequences {
            input_ids: Mat::filled(rows, 3, 1i64),
            attention_mask: Mat::filled(rows, 3, 1i64),
            response_len: 2,
        };
        Rollout {
            rows,
            r: 2,
            seq,
            response_mask: Mat::filled(rows, 2, 1.0f32),
            behaviour: Some((Mat::filled(rows, 2, -1.0f32), versions.to_vec())),
            prompt_text: vec![String::new(); rows],
            response_text: vec![String::new(); rows],
            ground_truth: None,
            has_eos: vec![true; rows],
            group_ids: (0..rows).collect(),
            prompt_rows: (0..rows).collect(),
            dropped_rows: Vec::new(),
            surplus_rows: Vec::new(),
            tokens: rows * 3,
            cursor: Default::default(),
            gen_s: 0.0,
            probe: Probe::None,
            scored: None,
        }
    }

    #[test]
    fn admission_drops_rows_beyond_the_bound_and_counts_them() {
        // Step 6 trains on weights version 5: lags 0, 1, 2, 3.
        let mut ro = batch(&[5, 4, 3, 2]);
        let a = admit(&mut ro, 6, 2).unwrap();
        assert_eq!(a.dropped, 1);
        assert_eq!((a.staleness_mean, a.staleness_max), (1.0, 2.0));
        assert_eq!(ro.response_mask.row(3), [0.0, 0.0]);
        assert_eq!(ro.response_mask.row(2), [1.0, 1.0]);

        let a = admit(&mut batch(&[5, 4, 3, 2]), 6, 3).unwrap();
        assert_eq!((a.dropped, a.staleness_max), (0, 3.0));

        let e = match admit(&mut batch(&[1, 1]), 6, 2) {
            Err(Failed::Other(e)) => e.to_string(),
            _ => panic!("a batch with every row too old must fail"),
        };
        assert!(
            e.contains("all 2 rows") && e.contains("max_staleness=2"),
            "{e}"
        );
    }

    #[test]
    fn schedule_of_each_mode() {
        let (lag, syncs) = lags(schedule(AsyncMode::Sync, 1));
        assert_eq!(lag, vec![0; 12]);
        assert_eq!(syncs, (1..12).collect::<Vec<_>>());

        // One step off: the first batch on the initial weights, every other one step old.
        let (lag, syncs) = lags(schedule(AsyncMode::OneStepOff, 1));
        assert_eq!(lag, [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]);
        assert_eq!(syncs, (1..12).collect::<Vec<_>>());

        // Bounded(3): syncs after steps 3, 6, 9; lags cycle through 1..=3, never above 3.
        let s = schedule(AsyncMode::Bounded, 3);
        let (lag, syncs) = lags(s);
        assert_eq!(lag, [0, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]);
        assert_eq!(syncs, [3, 6, 9]);
        assert_eq!(s.next_sync_after(0), 3);
        assert_eq!(s.next_sync_after(4), 6);
        // Every batch's version is a sync point (or the start) and never newer than the
        // trainer's weights when its step trains.
        for b in 1..40 {
            let v = s.version_for(b);
            assert!(v == 0 || s.is_sync_point(v), "batch {b}: version {v}");
            assert!(v < b, "batch {b}: version {v}");
        }
    }
}
