//! `rlhf-head submit` and `rlhf-head job list|status|logs|stop`: PPO jobs on a running head.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use rlhf_core::{Error, FailureKind, Result};
use rlhf_proto::v1 as pb;
use rlhf_runtime::head::jobs::{state_ended, state_name, state_text};
use rlhf_runtime::status::{job_json, job_time};

use crate::{Connect, Format};

#[derive(clap::Args, Clone)]
pub(crate) struct SubmitArgs {
    #[command(flatten)]
    pub(crate) conn: Connect,
    /// Directory of job configs.
    #[arg(long, default_value = "configs")]
    pub(crate) config_dir: PathBuf,
    /// Config name: <config-dir>/<NAME>.yaml (no .yaml).
    #[arg(long)]
    pub(crate) config_name: String,
    /// key.path=value overrides, e.g. actor_rollout.ppo_epochs=2.
    pub(crate) overrides: Vec<String>,
    /// Stay attached: print the driver's output until the job ends, and exit non-zero
    /// unless it succeeded.
    #[arg(long, short)]
    pub(crate) follow: bool,
}

#[derive(clap::Subcommand, Clone)]
pub(crate) enum JobCmd {
    /// Every job the head knows, oldest first.
    List {
        #[command(flatten)]
        conn: Connect,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// State, times, exit code, error and the last metrics line of one job.
    Status {
        job_id: String,
        #[command(flatten)]
        conn: Connect,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// The job driver's output.
    Logs {
        job_id: String,
        /// Keep printing new output until the job ends.
        #[arg(short, long)]
        follow: bool,
        #[command(flatten)]
        conn: Connect,
    },
    /// Stop a job: SIGTERM to its driver, SIGKILL after a grace period.
    Stop {
        job_id: String,
        /// Return once the stop is asked for, without waiting for the job to end.
        #[arg(long)]
        no_wait: bool,
        #[command(flatten)]
        conn: Connect,
    },
}

pub(crate) async fn submit(args: SubmitArgs) -> Result<()> {
    let mut cfg = rlhf_config::load(&args.config_dir, &args.config_name, &args.overrides)
        .map_err(|e| Error::invalid(e.to_string()))?;
    let cwd = std::env::current_dir().map_err(|e| Error::io("reading the current directory", e))?;
    // The driver runs in the head's job directory: relative paths would point there.
    cfg.absolutize_paths(&cwd);
    let mut c = crate::client(&args.conn).await?;
    let job = c
        .submit_job(pb::SubmitJobRequest {
            bundle: cfg.to_bundle(),
            config_name: args.config_name.clone(),
            overrides: args.overrides.clone(),
            metrics_file: cfg.logging.metrics_file.clone(),
            samples_file: cfg.logging.samples_file.clone(),
        })
        .await
        .map_err(Error::from)?
        .into_inner()
        .job
        .unwrap_or_default();
    if job.state == pb::JobState::Failed as i32 {
        return Err(Error::internal(format!(
            "job {} failed to start: {}",
            job.job_id, job.error
        )));
    }
    println!("submitted job {} ({})", job.job_id, state_text(&job));
    println!("  follow it:  rlhf-head job logs -f {}", job.job_id);
    println!("  status:     rlhf-head job status {}", job.job_id);
    println!("  stop it:    rlhf-head job stop {}", job.job_id);
    if !args.follow {
        return Ok(());
    }
    let j = print_logs(&mut c, &job.job_id, true).await?;
    if j.state == pb::JobState::Succeeded as i32 {
        eprintln!("job {} {}", j.job_id, ended_text(&j));
        Ok(())
    } else {
        Err(Error::internal(format!(
            "job {} {}",
            j.job_id,
            ended_text(&j)
        )))
    }
}

fn duration_text(j: &pb::JobInfo, now_ms: i64) -> String {
    if j.start_ms <= 0 {
        return "-".into();
    }
    let end = if j.end_ms > 0 { j.end_ms } else { now_ms };
    let s = (end - j.start_ms).max(0) / 1000;
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn exit_text(j: &pb::JobInfo) -> String {
    match (j.has_exit_code, j.signal) {
        (true, _) => j.exit_code.to_string(),
        (false, s) if s != 0 => format!("signal {s}"),
        _ => "-".into(),
    }
}

fn status_text(j: &pb::JobInfo) -> String {
    let mut o = format!(
        "job:        {}\nstate:      {}\nconfig:     {}",
        j.job_id,
        state_text(j),
        j.config_name
    );
    if !j.overrides.is_empty() {
        o += &format!(" {}", j.overrides.join(" "));
    }
    o += &format!(
        "\nsubmitted:  {}\nstarted:    {}\nended:      {}\nduration:   {}\nexit:       {}\n",
        utc(j.submit_ms),
        utc(j.start_ms),
        utc(j.end_ms),
        duration_text(j, now_ms()),
        exit_text(j)
    );
    if !j.error.is_empty() {
        o += &format!("error:      {}\n", j.error);
    }
    if !j.failure_kind.is_empty() {
        let at = match (j.failure_role.is_empty(), j.failure_rank) {
            (false, r) if r >= 0 => format!(" in {} rank {r}", j.failure_role),
            (false, _) => format!(" in {}", j.failure_role),
            _ => String::new(),
        };
        let again = if j.retryable {
            "running it again (--resume latest) may succeed"
        } else {
            "needs a change before running again"
        };
        o += &format!("failure:    {}{at}; {again}\n", j.failure_kind);
    }
    if !j.last_metrics.is_empty() {
        o += &format!("metrics:    {}\n", j.last_metrics);
    }
    o += &format!("log:        {}\n", j.log_file);
    o
}

/// A time with its zone, or `-` when not reached yet.
fn utc(ms: i64) -> String {
    match job_time(ms) {
        t if t == "-" => t,
        t => format!("{t} UTC"),
    }
}

fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

pub(crate) async fn job(cmd: JobCmd) -> Result<()> {
    match cmd {
        JobCmd::List { conn, format } => {
            let mut c = crate::client(&conn).await?;
            let jobs = c
                .list_jobs(pb::ListJobsRequest {})
                .await
                .map_err(Error::from)?
                .into_inner()
                .jobs;
            match format {
                Format::Json => print_json(&serde_json::Value::Array(
                    jobs.iter().map(job_json).collect(),
                )),
                Format::Text => {
                    if jobs.is_empty() {
                        println!("no jobs; submit one with `rlhf-head submit --config-name NAME`");
                    }
                    let now = now_ms();
                    for j in &jobs {
                        let mut line = format!(
                            "{}  {:<9}  {:<20}  {}  {}",
                            j.job_id,
                            state_text(j),
                            j.config_name,
                            utc(j.submit_ms),
                            duration_text(j, now)
                        );
                        if !j.error.is_empty() {
                            line += &format!("  {}", j.error);
                        }
                        println!("{line}");
                    }
                }
            }
            Ok(())
        }
        JobCmd::Status {
            job_id,
            conn,
            format,
        } => {
            let mut c = crate::client(&conn).await?;
            let j = get(&mut c, &job_id).await?;
            match format {
                Format::Json => print_json(&job_json(&j)),
                Format::Text => print!("{}", status_text(&j)),
            }
            Ok(())
        }
        JobCmd::Logs {
            job_id,
            follow,
            conn,
        } => {
            let mut c = crate::client(&conn).await?;
            let j = print_logs(&mut c, &job_id, follow).await?;
            if follow {
                eprintln!("job {} {}", j.job_id, ended_text(&j));
            }
            Ok(())
        }
        JobCmd::Stop {
            job_id,
            no_wait,
            conn,
        } => {
            let mut c = crate::client(&conn).await?;
            let j = c
                .stop_job(pb::StopJobRequest {
                    job_id: job_id.clone(),
                })
                .await
                .map_err(Error::from)?
                .into_inner()
                .job
                .unwrap_or_default();
            if state_ended(j.state) {
                println!("job {} had already ended: {}", j.job_id, ended_text(&j));
                return Ok(());
            }
            if no_wait {
                println!("stopping job {}", j.job_id);
                return Ok(());
            }
            // The head escalates to SIGKILL after its grace period; wait a bit beyond it.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            loop {
                let j = get(&mut c, &job_id).await?;
                if state_ended(j.state) {
                    println!("job {} {}", j.job_id, ended_text(&j));
                    return Ok(());
                }
                if tokio::time::Instant::now() > deadline {
                    return Err(Error::new(
                        FailureKind::Timeout,
                        format!(
                            "job {job_id} is still {} 120 s after the stop; its driver has pid {} on the head's machine",
                            state_name(j.state),
                            j.pid
                        ),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

type Client =
    rlhf_proto::v1::head_service_client::HeadServiceClient<rlhf_runtime::net::AuthChannel>;

/// Prints the job's log; with `follow`, keeps polling until the job has ended and its log
/// is drained. Returns the job as it is afterwards.
async fn print_logs(c: &mut Client, job_id: &str, follow: bool) -> Result<pb::JobInfo> {
    let mut offset = 0;
    let mut out = std::io::stdout();
    loop {
        let r = c
            .job_logs(pb::JobLogsRequest {
                job_id: job_id.to_string(),
                offset,
                max_bytes: 0,
            })
            .await
            .map_err(Error::from)?
            .into_inner();
        let got = !r.data.is_empty();
        out.write_all(&r.data)
            .and_then(|_| out.flush())
            .map_err(|e| Error::io("writing the log to stdout", e))?;
        offset = r.next_offset;
        // Without follow: everything written so far, in as many chunks as it takes.
        if r.finished || (!follow && !got) {
            return get(c, job_id).await;
        }
        if !got {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

fn ended_text(j: &pb::JobInfo) -> String {
    let mut s = state_name(j.state).to_string();
    if j.has_exit_code || j.signal != 0 {
        s += &format!(" (exit {})", exit_text(j));
    }
    if !j.error.is_empty() {
        s += &format!(": {}", j.error);
    }
    s
}

async fn get(c: &mut Client, id: &str) -> Result<pb::JobInfo> {
    Ok(c.get_job(pb::GetJobRequest {
        job_id: id.to_string(),
    })
    .await
    .map_err(Error::from)?
    .into_inner()
    .job
    .unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn configs() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
    }

    #[test]
    fn absolutized_config_survives_the_bundle_the_head_receives() {
        let mut cfg = rlhf_config::load(&configs(), "ppo_tiny", &[]).unwrap();
        // The model path must exist under the base to become absolute (a relative name that
        // does not is kept as a Hugging Face repo id); the model is given by absolute path.
        let model = configs()
            .join("../models/tiny")
            .to_string_lossy()
            .into_owned();
        cfg.actor_rollout.model = model.clone();
        cfg.absolutize_paths(Path::new("/home/u/proj"));
        let back = rlhf_config::from_bundle(&cfg.to_bundle()).unwrap();
        assert_eq!(back.data.path, "/home/u/proj/data/prompts_tiny.jsonl");
        assert_eq!(back.actor_rollout.model, model);
        assert_eq!(
            back.logging.metrics_file,
            "/home/u/proj/logs/ppo_tiny/metrics.jsonl"
        );
    }

    #[test]
    fn status_text_shows_times_exit_error_and_metrics() {
        let j = pb::JobInfo {
            job_id: "job-1".into(),
            state: pb::JobState::Failed as i32,
            config_name: "ppo_tiny".into(),
            submit_ms: 1_700_000_000_000,
            start_ms: 1_700_000_001_000,
            end_ms: 1_700_000_062_000,
            has_exit_code: true,
            exit_code: 3,
            error: "boom".into(),
            last_metrics: "{\"step\":2}".into(),
            log_file: "/s/jobs/job-1/driver.log".into(),
            ..Default::default()
        };
        let t = status_text(&j);
        for want in [
            "state:      FAILED",
            "submitted:  2023-11-14 22:13:20 UTC",
            "started:    2023-11-14 22:13:21 UTC",
            "ended:      2023-11-14 22:14:22 UTC",
            "duration:   0:01:01",
            "exit:       3",
            "error:      boom",
            "metrics:    {\"step\":2}",
        ] {
            assert!(t.contains(want), "{want} not in\n{t}");
        }
        assert_eq!(
            ended_text(&pb::JobInfo {
                state: pb::JobState::Stopped as i32,
                signal: 15,
                ..Default::default()
            }),
            "STOPPED (exit signal 15)"
        );
    }
}
