//! Bad input across the CLIs, one table: flags, job configs and overrides, datasets, model
//! directories, checkpoints, tokens, certificates, state directories and resources. Every
//! case runs the real binary under a deadline and must end with a non-zero exit, an error
//! that names the problem (the expected text), and no panic. Wire-level bad input (node
//! reports, batch streams, collective peers) is covered where those servers are tested.

use std::time::Duration;

use anyhow::Result;

#[path = "bad_input/fixtures.rs"]
mod fixtures;

use fixtures::{run, Bin, Fixtures};

#[test]
fn every_bad_input_gets_a_clear_error_and_no_panic() -> Result<()> {
    let f = Fixtures::new()?;
    let p = |n: &str| f.p(n);
    let tiny = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["check", "--config-name", "ppo_tiny"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let run_tiny = |extra: &[String]| -> Vec<String> {
        let mut v: Vec<String> = ["run", "--config-name", "ppo_tiny"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.push(format!("checkpoint.dir={}", p("run-ck")));
        v.push(format!("logging.metrics_file={}", p("run-m.jsonl")));
        v.extend(extra.iter().cloned());
        v
    };
    let s = |v: &[&str]| -> Vec<String> { v.iter().map(|x| x.to_string()).collect() };
    let gen = |model: &str| s(&["generate", "--model", model, "--prompt", "hi"]);
    let join = |extra: &[&str]| -> Vec<String> {
        let mut v = s(&["join", "--address", "127.0.0.1:1", "--connect-timeout", "1"]);
        v.push("--state-dir".into());
        v.push(p("wstate"));
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let status = |extra: &[&str]| -> Vec<String> {
        let mut v = s(&[
            "status",
            "--address",
            "127.0.0.1:1",
            "--connect-timeout",
            "1",
        ]);
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let good_token = p("good-token");
    let cases: Vec<(&str, Bin, Vec<String>, &str)> =
        vec![
        // Job configs and overrides.
        (
            "negative integer",
            Bin::Head,
            tiny(&["training.train_iters=-1"]),
            "expected a non-negative integer",
        ),
        (
            "not a number",
            Bin::Head,
            tiny(&["training.lr=abc"]),
            "expected a number",
        ),
        (
            "unknown key",
            Bin::Head,
            tiny(&["training.nope=1"]),
            "unknown key 'training.nope'",
        ),
        (
            "no such config",
            Bin::Head,
            s(&["check", "--config-name", "ppo_tinyy"]),
            "no such config",
        ),
        (
            "config dir without configs",
            Bin::Head,
            s(&[
                "check",
                "--config-dir",
                &p("no-configs"),
                "--config-name",
                "ppo_tiny",
            ]),
            "--config-name takes one of []",
        ),
        (
            "batch does not divide",
            Bin::Head,
            tiny(&["training.global_batch_size=7"]),
            "not divisible by actor_rollout.ppo_mini_batch_size",
        ),
        (
            "unknown device",
            Bin::Head,
            tiny(&["resource_pool.device=TPU"]),
            "unknown variant `TPU`",
        ),
        (
            "unknown estimator",
            Bin::Head,
            tiny(&["algorithm.adv_estimator=foo"]),
            "unknown variant `foo`",
        ),
        (
            "gamma out of range",
            Bin::Head,
            tiny(&["algorithm.gamma=2"]),
            "must lie in [0, 1]",
        ),
        (
            "negative temperature",
            Bin::Head,
            tiny(&["actor_rollout.temperature=-1"]),
            "must be > 0 when do_sample",
        ),
        (
            "override without =",
            Bin::Head,
            tiny(&["noequals"]),
            "expected key.path=value",
        ),
        (
            "zero micro batch",
            Bin::Head,
            tiny(&["training.micro_batch_size=0"]),
            "micro_batch_size must be > 0",
        ),
        (
            "pool smaller than the role",
            Bin::Head,
            tiny(&["resource_pool.actor_rollout=0"]),
            "!= resource_pool.actor_rollout (0)",
        ),
        (
            "integer beyond u64",
            Bin::Head,
            tiny(&["training.train_iters=18446744073709551616"]),
            "training.train_iters=18446744073709551616",
        ),
        (
            "kl controller type",
            Bin::Head,
            tiny(&["algorithm.kl_ctrl.type=pid"]),
            "unknown variant `pid`",
        ),
        (
            "list for a scalar",
            Bin::Head,
            tiny(&["training.lr=[1,2]"]),
            "training.lr",
        ),
        (
            "flag value not a number",
            Bin::Head,
            s(&["run", "--config-name", "ppo_tiny", "--call-timeout", "abc"]),
            "invalid value 'abc'",
        ),
        (
            "infinite call timeout",
            Bin::Head,
            s(&["run", "--config-name", "ppo_tiny", "--call-timeout", "inf"]),
            "--call-timeout <CALL_TIMEOUT>': inf seconds is out of range",
        ),
        (
            "start timeout past 2^64 seconds",
            Bin::Head,
            s(&["run", "--config-name", "ppo_tiny", "--start-timeout", "1e20"]),
            "1e20 seconds is out of range",
        ),
        (
            "status connect timeout past 2^64 seconds",
            Bin::Head,
            s(&["status", "--connect-timeout", "18446744073709551616"]),
            "--connect-timeout <CONNECT_TIMEOUT>': 18446744073709551616 seconds is out of range",
        ),
        (
            "worker connect timeout infinite",
            Bin::Worker,
            s(&["join", "--address", "127.0.0.1:1", "--connect-timeout", "inf"]),
            "inf seconds is out of range: give a number from 0 to",
        ),
        // The vLLM rollout engine: the worker's Python and the job's settings.
        (
            "worker vllm python missing",
            Bin::Worker,
            join(&["--vllm-python", "/nonexistent/bin/python"]),
            "--vllm-python (or RLHF_VLLM_PYTHON) /nonexistent/bin/python: no such file",
        ),
        (
            "vllm run without a vllm python",
            Bin::Head,
            {
                let mut v = run_tiny(&[]);
                v[2] = "ppo_tiny_vllm".into();
                v
            },
            "the embedded worker has no vLLM Python; set RLHF_VLLM_PYTHON",
        ),
        (
            "vllm with the hybrid engine",
            Bin::Head,
            tiny(&["actor_rollout.engine=vllm", "resource_pool.colocate=true"]),
            "set actor_rollout.hybrid_engine=false",
        ),
        (
            "vllm extra argument that loads code",
            Bin::Head,
            tiny(&[
                "actor_rollout.engine=vllm",
                "actor_rollout.vllm.extra_args=[--trust-remote-code]",
            ]),
            "actor_rollout.vllm.extra_args[0] (\"--trust-remote-code\"): not an engine argument a job may set",
        ),
        (
            "vllm kv cache of a fraction",
            Bin::Head,
            tiny(&["actor_rollout.engine=vllm", "actor_rollout.vllm.kv_cache_gb=0.5"]),
            "actor_rollout.vllm.kv_cache_gb",
        ),
        (
            "math reward without ground truth",
            Bin::Head,
            tiny(&["reward.rule=math"]),
            "reward.rule is math but data.ground_truth_key is not set",
        ),
        // Datasets, tokenizers, checkpoints (the run stops before or right after placement).
        (
            "missing dataset",
            Bin::Head,
            run_tiny(&["data.path=/nonexistent/prompts.jsonl".into()]),
            "/nonexistent/prompts.jsonl",
        ),
        (
            "malformed dataset row",
            Bin::Head,
            run_tiny(&[format!("data.path={}", p("bad.jsonl"))]),
            "1 bad row(s)",
        ),
        (
            "empty dataset",
            Bin::Head,
            run_tiny(&[format!("data.path={}", p("empty.jsonl"))]),
            "no usable prompts",
        ),
        (
            "dataset without the prompt key",
            Bin::Head,
            run_tiny(&[format!("data.path={}", p("no-prompt.jsonl"))]),
            "prompt",
        ),
        (
            "missing tokenizer",
            Bin::Head,
            run_tiny(&["training.tokenizer_name_or_path=/nonexistent".into()]),
            "tokenizer.json",
        ),
        (
            "remax not run",
            Bin::Head,
            run_tiny(&["algorithm.adv_estimator=remax".into()]),
            "needs a greedy baseline",
        ),
        (
            "missing fixed responses",
            Bin::Head,
            run_tiny(&["actor_rollout.fixed_responses_file=/nonexistent.jsonl".into()]),
            "actor_rollout.fixed_responses_file",
        ),
        (
            "resume a missing checkpoint",
            Bin::Head,
            {
                let mut v = run_tiny(&[]);
                v.extend(s(&["--resume", "/nonexistent/global_step_3"]));
                v
            },
            "trainer_state.json not found",
        ),
        (
            "resume with no checkpoint",
            Bin::Head,
            {
                let mut v = s(&["run", "--config-name", "ppo_tiny", "--resume", "latest"]);
                v.push(format!("checkpoint.dir={}", p("no-ckpt")));
                v
            },
            "no checkpoint under",
        ),
        (
            "damaged trainer state",
            Bin::Head,
            {
                let mut v = s(&["run", "--config-name", "ppo_tiny", "--resume", "latest"]);
                v.push(format!("checkpoint.dir={}", p("ck")));
                v
            },
            "trainer_state.json",
        ),
        (
            "resume a checkpoint another cluster signed",
            Bin::Head,
            {
                let mut v = s(&["run", "--config-name", "ppo_tiny", "--resume", "latest"]);
                v.push(format!("checkpoint.dir={}", p("ck-foreign")));
                v
            },
            "was signed with another checkpoint key",
        ),
        (
            "trusted checkpoint whose manifest names a file outside it",
            Bin::Head,
            {
                let mut v = run_tiny(&[format!("checkpoint.dir={}", p("ck-escape"))]);
                v.extend(s(&["--resume", "latest", "--trust-checkpoint"]));
                v
            },
            "\"../../../../../../proc/self/environ\", which is not a plain file name",
        ),
        // Model directories.
        (
            "missing model dir",
            Bin::Cli,
            gen("/nonexistent"),
            "does not exist",
        ),
        (
            "truncated weights",
            Bin::Cli,
            gen(&p("m-truncated")),
            "model.safetensors",
        ),
        (
            "no weights",
            Bin::Cli,
            gen(&p("m-no-weights")),
            "model.safetensors",
        ),
        (
            "no tokenizer",
            Bin::Cli,
            gen(&p("m-no-tokenizer")),
            "tokenizer.json",
        ),
        (
            "config not JSON",
            Bin::Cli,
            gen(&p("m-bad-config")),
            "config.json",
        ),
        (
            "absurd layer count",
            Bin::Cli,
            gen(&p("m-huge-layers")),
            "at most 1024",
        ),
        (
            "layer count beyond the weights",
            Bin::Cli,
            gen(&p("m-extra-layer")),
            "weights hold 2 layer(s)",
        ),
        (
            "width not the weights'",
            Bin::Cli,
            gen(&p("m-wide")),
            "in the weights but the config implies",
        ),
        (
            "unsupported architecture",
            Bin::Cli,
            gen(&p("m-arch")),
            "GPT2LMHeadModel",
        ),
        (
            "top-p out of range",
            Bin::Cli,
            {
                let mut v = gen("models/tiny");
                v.extend(s(&["--top-p", "2"]));
                v
            },
            "--top-p must be in (0, 1]",
        ),
        (
            "negative temperature flag",
            Bin::Cli,
            {
                let mut v = gen("models/tiny");
                v.push("--temperature=-1".into());
                v
            },
            "--temperature must be >= 0",
        ),
        // Ports, addresses, tokens, certificates, state directories.
        (
            "port out of range",
            Bin::Head,
            s(&["start", "--port", "70000"]),
            "70000 is not in 0..=65535",
        ),
        (
            "unknown flag",
            Bin::Head,
            s(&["start", "--bogus"]),
            "unexpected argument '--bogus'",
        ),
        (
            "missing token file",
            Bin::Head,
            status(&["--token-file", "/nonexistent"]),
            "reading token file /nonexistent",
        ),
        (
            "empty token file",
            Bin::Head,
            status(&["--token-file", &p("empty-token")]),
            "is empty",
        ),
        (
            "unreachable head",
            Bin::Head,
            status(&["--token-file", &good_token]),
            "cannot reach 127.0.0.1:1",
        ),
        (
            "unresolvable head",
            Bin::Head,
            s(&[
                "status",
                "--address",
                "nohost.invalid:1",
                "--connect-timeout",
                "1",
                "--token-file",
                &good_token,
            ]),
            "cannot reach nohost.invalid:1",
        ),
        (
            "missing certificate",
            Bin::Head,
            s(&[
                "start",
                "--port",
                "0",
                "--tls-cert",
                "/nonexistent",
                "--tls-key",
                "/nonexistent",
                "--state-dir",
                &p("hs1"),
            ]),
            "--tls-cert /nonexistent",
        ),
        (
            "certificate that is not PEM",
            Bin::Head,
            s(&[
                "start",
                "--port",
                "0",
                "--tls-cert",
                &p("not-pem"),
                "--tls-key",
                &p("not-pem"),
                "--state-dir",
                &p("hs2"),
            ]),
            "no PEM block with a CERTIFICATE",
        ),
        (
            "CA that is not PEM",
            Bin::Head,
            status(&["--token-file", &good_token, "--tls-ca", &p("not-pem")]),
            "no PEM block with a CERTIFICATE",
        ),
        (
            "certificate without key",
            Bin::Head,
            s(&["start", "--tls-cert", &p("not-pem")]),
            "--tls-key",
        ),
        (
            "state dir is a file",
            Bin::Head,
            s(&["start", "--port", "0", "--state-dir", &p("a-file")]),
            "is not a directory",
        ),
        (
            "planted token",
            Bin::Head,
            s(&["start", "--port", "0", "--state-dir", &p("planted")]),
            "mode 666",
        ),
        // Worker resources and TLS.
        (
            "negative resource",
            Bin::Worker,
            join(&["--resources", r#"{"GPU": -1}"#]),
            "must be a finite number >= 0",
        ),
        (
            "resources not an object",
            Bin::Worker,
            join(&["--resources", "[1]"]),
            "expected a JSON object",
        ),
        (
            "resource not a number",
            Bin::Worker,
            join(&["--resources", r#"{"GPU": "x"}"#]),
            "must be a number",
        ),
        (
            "resource out of range",
            Bin::Worker,
            join(&["--resources", r#"{"GPU": 1e999}"#]),
            "malformed JSON",
        ),
        (
            "more devices than a node has",
            Bin::Worker,
            join(&["--resources", r#"{"GPU": 4294967296}"#]),
            "more devices than a node can offer",
        ),
        (
            "resources cut short",
            Bin::Worker,
            join(&["--resources", "{"]),
            "malformed JSON at line 1",
        ),
        (
            "TLS worker for a plain head",
            Bin::Worker,
            join(&["--tls-cert", &p("not-pem"), "--tls-key", &p("not-pem")]),
            "--tls-cert without --tls-ca",
        ),
        (
            "plain worker for a TLS head",
            Bin::Worker,
            join(&["--tls-ca", &p("not-pem")]),
            "give this worker --tls-cert",
        ),
        (
            "worker CA missing",
            Bin::Worker,
            join(&[
                "--tls-ca",
                "/nonexistent",
                "--tls-cert",
                "/a",
                "--tls-key",
                "/b",
                "--token-file",
                &good_token,
            ]),
            "--tls-ca /nonexistent",
        ),
    ];
    assert!(cases.len() >= 50, "{} cases", cases.len());
    let mut failures = Vec::new();
    for (name, bin, args, want) in &cases {
        match run(bin, args, Duration::from_secs(60)) {
            Ok((ok, err)) => {
                if ok || !err.contains(want) || err.contains("panicked") {
                    failures.push(format!(
                        "{name}: exit ok={ok}, expected {want:?} in:\n{err}"
                    ));
                }
                if let Some(left) = litter(&err) {
                    failures.push(format!("{name}: {left}"));
                }
            }
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n---\n")
    );
    Ok(())
}

/// What a failed embedded run wrongly leaves behind: its state directory (named at start,
/// "logs under DIR") must be gone unless the error names the role processes' logs in it.
fn litter(err: &str) -> Option<String> {
    let dir = err
        .split("(logs under ")
        .nth(1)?
        .split(')')
        .next()?
        .to_string();
    let kept = err
        .split("the role processes' logs are under ")
        .nth(1)
        .and_then(|l| l.lines().next());
    match kept {
        Some(logs) if !logs.starts_with(&dir) || !std::path::Path::new(logs).is_dir() => Some(
            format!("the error names role logs at {logs}, not a directory under {dir}"),
        ),
        Some(_) => None,
        None => std::path::Path::new(&dir).exists().then(|| {
            format!("the state directory {dir} of a run that started no role process was left")
        }),
    }
}
