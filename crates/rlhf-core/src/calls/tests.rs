//! Every call type survives the wire, and the errors name the call and the tensor.

use super::*;

fn seq(rows: usize, p: usize, r: usize) -> Sequences {
    let t = p + r;
    Sequences {
        input_ids: Mat::new(rows, t, (0..(rows * t) as i64).collect()).unwrap(),
        attention_mask: Mat::filled(rows, t, 1),
        response_len: r,
    }
}

fn f32s(rows: usize, cols: usize, base: f32) -> Mat<f32> {
    Mat::new(
        rows,
        cols,
        (0..rows * cols).map(|i| base + i as f32 * 0.5).collect(),
    )
    .unwrap()
}

fn round_trip<T: RoleCall + std::fmt::Debug + PartialEq>(req: T) {
    let wire = req.to_batch().unwrap();
    let back = T::from_batch(T::CALL, &wire).unwrap();
    assert_eq!(back, req);
}

#[test]
fn requests_round_trip() {
    round_trip(GenerateRequest {
        prompt_ids: Mat::new(2, 3, vec![0, 5, 6, 7, 8, 9]).unwrap(),
        prompt_mask: Mat::new(2, 3, vec![0, 1, 1, 1, 1, 1]).unwrap(),
        step: 4,
        seed: 42,
    });
    round_trip(LogProbsRequest(seq(3, 4, 2)));
    round_trip(ValuesRequest(seq(1, 2, 5)));
    round_trip(ScoresRequest {
        seq: seq(2, 3, 2),
        prompt_text: vec!["a".into(), "b".into()],
        response_text: vec!["1".into(), "".into()],
        ground_truth: Some(vec![Some("1".into()), None]),
    });
    round_trip(ActorUpdateRequest {
        seq: seq(2, 3, 2),
        response_mask: f32s(2, 2, 1.0),
        old_log_probs: f32s(2, 2, -3.0),
        advantages: f32s(2, 2, 0.25),
        ref_log_probs: Some(f32s(2, 2, -2.0)),
        step: 7,
    });
    round_trip(CriticUpdateRequest {
        seq: seq(2, 3, 2),
        value_mask: f32s(2, 2, 1.0),
        values: f32s(2, 2, 0.1),
        returns: f32s(2, 2, 0.2),
        step: 1,
    });
    round_trip(SftUpdateRequest {
        seq: seq(2, 3, 2),
        loss_mask: f32s(2, 2, 1.0),
        step: 3,
    });
    let mut rejected = seq(2, 3, 2);
    rejected.input_ids.data.reverse();
    for (ref_chosen, kto_kl) in [(Some(vec![-3.0, -4.5]), Some(0.25)), (None, None)] {
        round_trip(PreferenceUpdateRequest {
            chosen: seq(2, 3, 2),
            chosen_mask: f32s(2, 2, 1.0),
            rejected: rejected.clone(),
            rejected_mask: f32s(2, 2, 0.0),
            ref_rejected: ref_chosen
                .as_ref()
                .map(|v| v.iter().map(|x| x - 1.0).collect()),
            ref_chosen,
            kto_kl,
            step: 9,
        });
    }
    for margin in [Some(vec![0.5, 1.0]), None] {
        round_trip(RewardModelUpdateRequest {
            chosen: seq(2, 3, 2),
            rejected: rejected.clone(),
            margin,
            step: 2,
        });
    }
}

#[test]
fn pair_calls_name_the_missing_side() {
    let mut b = PreferenceUpdateRequest {
        chosen: seq(2, 3, 2),
        chosen_mask: f32s(2, 2, 1.0),
        rejected: seq(2, 3, 2),
        rejected_mask: f32s(2, 2, 1.0),
        ref_chosen: None,
        ref_rejected: None,
        kto_kl: None,
        step: 1,
    }
    .to_batch()
    .unwrap();
    b.tensors.remove("rejected_input_ids");
    let e = PreferenceUpdateRequest::from_batch(BatchCall::UpdatePreference, &b)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("UpdatePreference") && e.contains("rejected_input_ids"),
        "{e}"
    );
}

#[test]
fn responses_round_trip_and_concatenate_across_ranks() {
    let a = GenerateResponse {
        responses: Mat::new(1, 2, vec![3, 4]).unwrap(),
        response_mask: Mat::new(1, 2, vec![1.0, 0.0]).unwrap(),
        behaviour_log_probs: Mat::new(1, 2, vec![-0.5, 0.0]).unwrap(),
        policy_version: vec![3],
    };
    let mut b = a.clone();
    b.responses.data = vec![5, 6];
    b.policy_version = vec![4];
    let wire = DataBatch::concat(&[a.to_batch().unwrap(), b.to_batch().unwrap()]).unwrap();
    let both = GenerateResponse::from_batch(BatchCall::Generate, &wire).unwrap();
    assert_eq!(both.responses.data, vec![3, 4, 5, 6]);
    assert_eq!(both.policy_version, vec![3, 4]);

    let lp = LogProbsResponse {
        log_probs: f32s(2, 3, -1.0),
        entropy: f32s(2, 3, 2.0),
    };
    let back = LogProbsResponse::from_batch(BatchCall::ComputeLogProbs, &lp.to_batch().unwrap());
    assert_eq!(back.unwrap(), lp);
    let sc = ScoresResponse {
        scores: vec![0.5, -1.0],
        verdicts: None,
    };
    let back = ScoresResponse::from_batch(BatchCall::ComputeScores, &sc.to_batch().unwrap());
    assert_eq!(back.unwrap(), sc);
    let sc = ScoresResponse {
        scores: vec![1.0, 0.0, 0.0],
        verdicts: Some(vec![Verdict::Right, Verdict::Wrong, Verdict::NoAnswer]),
    };
    let mut wire = sc.to_batch().unwrap();
    let back = ScoresResponse::from_batch(BatchCall::ComputeScores, &wire);
    assert_eq!(back.unwrap(), sc);
    wire.tensors.insert(
        "verdicts".into(),
        TensorData::from_f32(vec![3], &[1.0, 0.5, 0.0]).unwrap(),
    );
    let e = ScoresResponse::from_batch(BatchCall::ComputeScores, &wire).unwrap_err();
    assert!(e.to_string().contains("verdict code 0.5 in row 1"), "{e}");
}

#[test]
fn update_metrics_keep_non_finite_values_visible() {
    let mut m = BTreeMap::new();
    m.insert("loss/policy_avg".to_string(), f64::NAN);
    m.insert("actor/lr".to_string(), 1e-5);
    let wire = UpdateResponse { metrics: m }.to_batch().unwrap();
    let back = UpdateResponse::from_batch(BatchCall::UpdateActor, &wire).unwrap();
    assert!(back.metrics["loss/policy_avg"].is_nan());
    assert_eq!(back.metrics["actor/lr"], 1e-5);
}

#[test]
fn errors_name_the_call_and_the_tensor() {
    let full = ActorUpdateRequest {
        seq: seq(2, 3, 2),
        response_mask: f32s(2, 2, 1.0),
        old_log_probs: f32s(2, 2, -3.0),
        advantages: f32s(2, 2, 0.25),
        ref_log_probs: None,
        step: 7,
    };
    let mut wire = full.to_batch().unwrap();
    wire.tensors.remove("advantages");
    let err = ActorUpdateRequest::from_batch(BatchCall::UpdateActor, &wire)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("UpdateActor") && err.contains("'advantages'"),
        "{err}"
    );

    // A float tensor where ids belong.
    let mut wire = LogProbsRequest(seq(2, 3, 2)).to_batch().unwrap();
    wire.tensors.insert(
        "input_ids".into(),
        TensorData::from_f32(vec![2, 5], &[0.0; 10]).unwrap(),
    );
    let err = LogProbsRequest::from_batch(BatchCall::ComputeLogProbs, &wire)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ComputeLogProbs") && err.contains("'input_ids'") && err.contains("I64"),
        "{err}"
    );

    // A response length that leaves no prompt.
    let mut s = seq(1, 3, 2);
    s.response_len = 5;
    let err = ValuesRequest::from_batch(
        BatchCall::ComputeValues,
        &ValuesRequest(s).to_batch().unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("response_length 5"), "{err}");

    // A non-string text.
    let mut wire = ScoresRequest {
        seq: seq(1, 3, 2),
        prompt_text: vec!["p".into()],
        response_text: vec!["r".into()],
        ground_truth: None,
    }
    .to_batch()
    .unwrap();
    wire.columns.insert("response_text".into(), vec![json!(3)]);
    let err = ScoresRequest::from_batch(BatchCall::ComputeScores, &wire)
        .unwrap_err()
        .to_string();
    assert!(err.contains("'response_text' row 0 is 3"), "{err}");
}

#[test]
fn stream_seeds_differ_by_step_and_rank_and_repeat() {
    let s = stream_seed(42, 3, 1);
    assert_eq!(s, stream_seed(42, 3, 1));
    assert_ne!(s, stream_seed(42, 3, 0));
    assert_ne!(s, stream_seed(42, 4, 1));
    assert_ne!(s, stream_seed(43, 3, 1));
}

#[test]
fn mat_checks_its_length_and_joins_halves() {
    assert!(Mat::<i64>::new(2, 3, vec![0; 5]).is_err());
    let a = Mat::new(2, 1, vec![1i64, 2]).unwrap();
    let b = Mat::new(2, 2, vec![3i64, 4, 5, 6]).unwrap();
    let j = Mat::hcat(&a, &b).unwrap();
    assert_eq!(j.shape(), [2, 3]);
    assert_eq!(j.data, vec![1, 3, 4, 2, 5, 6]);
    assert!(Mat::hcat(&a, &Mat::new(1, 1, vec![0i64]).unwrap()).is_err());
}
