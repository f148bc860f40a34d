//! The worker's memory samples of its actors, sent to the head every few seconds so the
//! dashboard's roles table and `status --format json` show what each role process holds.
//! Best effort: a sample that does not reach the head is dropped (the next one follows), and
//! a head too old to take them ends the loop.

use std::sync::Arc;
use std::time::Duration;

use rlhf_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use super::Agent;

/// Between two samples.
const PERIOD: Duration = Duration::from_secs(5);
/// Deadline of one report.
const REPORT_TIMEOUT: Duration = Duration::from_secs(2);

/// Resident memory of a process in bytes (`/proc/<pid>/statm`: pages); `None` when it is gone.
pub(super) fn rss_bytes(pid: i32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok().filter(|p| *p > 0).unwrap_or(4096))
}

pub(super) async fn run(agent: Arc<Agent>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let actors: Vec<pb::ActorUsage> = crate::lock(&agent.actors)
            .values()
            .filter(|p| p.info.pid > 0)
            .filter_map(|p| {
                Some(pb::ActorUsage {
                    actor_id: p.info.actor_id.clone(),
                    rss_bytes: rss_bytes(p.info.pid)?,
                })
            })
            .collect();
        if actors.is_empty() {
            continue;
        }
        let req = pb::ReportActorUsageRequest {
            node_id: crate::lock(&agent.node_id).clone(),
            actors,
        };
        let mut head = agent.head.clone();
        match tokio::time::timeout(REPORT_TIMEOUT, head.report_actor_usage(req)).await {
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                tracing::info!(
                    "the head takes no memory samples (an older version); not sending them"
                );
                return;
            }
            Ok(Err(s)) => tracing::debug!("memory sample not delivered: {}", s.message()),
            Err(_) => tracing::debug!("memory sample not delivered within {REPORT_TIMEOUT:?}"),
            Ok(Ok(_)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rss_of_this_process() {
        let rss = super::rss_bytes(std::process::id() as i32).unwrap();
        // A test binary holds at least a megabyte and surely less than the machine.
        assert!(rss > 1 << 20 && rss < 1 << 40, "{rss}");
        assert_eq!(super::rss_bytes(-5), None);
    }
}
