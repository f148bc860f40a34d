//! Rewards: HTTP scoring against a tiny local server, and the reward model.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::thread;

use rlhf_config::RewardKind;
use rlhf_roles::HttpReward;
use serde_json::{json, Value};

/// Serves `n` requests; `answer` maps the request JSON to (status, body).
fn server(n: usize, answer: fn(&Value) -> (u16, String)) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/score", l.local_addr().unwrap());
    thread::spawn(move || {
        for _ in 0..n {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                if line == "\r\n" || line.is_empty() {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
            }
            let mut body = vec![0u8; len];
            r.read_exact(&mut body).unwrap();
            let req: Value = serde_json::from_slice(&body).unwrap();
            let (code, text) = answer(&req);
            let mut s = s;
            write!(
                s,
                "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            )
            .unwrap();
        }
    });
    url
}

fn texts() -> (Vec<String>, Vec<String>) {
    (
        vec!["p1".into(), "p2".into(), "p3".into()],
        vec!["a".into(), "bbb".into(), "cc".into()],
    )
}

#[test]
fn http_reward_scores_and_explains_bad_answers() {
    let url = server(1, |req| {
        let scores: Vec<f64> = req["responses"]
            .as_array()
            .unwrap()
            .iter()
            .zip(req["prompts"].as_array().unwrap())
            .map(|(r, p)| {
                r.as_str().unwrap().len() as f64 + p.as_str().unwrap().len() as f64 / 10.0
            })
            .collect();
        (200, json!({ "scores": scores }).to_string())
    });
    let (p, r) = texts();
    let got = HttpReward::new(&url, 5.0).unwrap().score(&p, &r).unwrap();
    assert_eq!(got, vec![1.2, 3.2, 2.2]);

    let url = server(1, |_| (200, json!({ "scores": [1.0, 2.0] }).to_string()));
    let err = HttpReward::new(&url, 5.0)
        .unwrap()
        .score(&p, &r)
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 scores for 3 responses"), "{err}");

    let url = server(1, |_| (500, "model crashed".into()));
    let err = HttpReward::new(&url, 5.0)
        .unwrap()
        .score(&p, &r)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("HTTP 500") && err.contains("model crashed"),
        "{err}"
    );

    let url = server(1, |_| (200, json!({ "rewards": [1, 2, 3] }).to_string()));
    let err = HttpReward::new(&url, 5.0)
        .unwrap()
        .score(&p, &r)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no \"scores\" array"), "{err}");

    // Nobody answers: the timeout fires with a clear message.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/", silent.local_addr().unwrap());
    let err = HttpReward::new(&url, 0.3)
        .unwrap()
        .score(&p, &r)
        .unwrap_err()
        .to_string();
    assert!(err.contains("request failed (timeout 0.3 s)"), "{err}");
    drop(silent);

    assert!(HttpReward::new("ftp://x", 1.0).is_err());
}

#[test]
fn reward_from_config_rule_http_and_model() {
    let mut cfg = common::config();
    cfg.reward.kind = RewardKind::Rule;
    cfg.reward.rule = "nope".into();
    let err = common::reward(&cfg).err().unwrap().to_string();
    assert!(err.contains("contains_digit, length, exact_match"), "{err}");

    cfg.reward.kind = RewardKind::Http;
    cfg.reward.url = server(1, |_| (200, json!({ "scores": [0.5, -1.0] }).to_string()));
    let reward = common::reward(&cfg).unwrap();
    let batch = common::sequences(&[2, 3], 1)
        .with_column("prompt_text", vec!["x".into(), "y".into()])
        .with_column("response_text", vec!["1".into(), "2".into()]);
    let out = common::scores_of(&reward, &batch).unwrap();
    assert_eq!(out.tensors["scores"].to_f32().unwrap(), vec![0.5, -1.0]);
    let mut no_text = batch.clone();
    no_text.columns.remove("prompt_text");
    let err = common::scores_of(&reward, &no_text)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no column 'prompt_text'"), "{err}");

    cfg.reward.kind = RewardKind::Model;
    cfg.reward.model = common::fixture("tiny-llama-reward").display().to_string();
    let reward = common::reward(&cfg).unwrap();
    let out = common::scores_of(&reward, &batch).unwrap();
    let s = out.tensors["scores"].to_f32().unwrap();
    assert_eq!(s.len(), 2);
    assert!(s.iter().all(|x| x.is_finite()) && s[0] != s[1], "{s:?}");
}
