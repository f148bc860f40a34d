//! Tests of batch/: splitting, gathering, padding, the encoding and its streaming.

use super::wire::*;
use super::*;
use rlhf_proto::v1 as pb;
use serde_json::json;

fn sample(rows: usize) -> DataBatch {
    let ids: Vec<i64> = (0..rows as i64 * 3).collect();
    let lp: Vec<f32> = (0..rows * 3).map(|i| i as f32 * 0.5).collect();
    DataBatch::new()
        .with_tensor(
            "input_ids",
            TensorData::from_i64(vec![rows, 3], &ids).unwrap(),
        )
        .with_tensor(
            "logprobs",
            TensorData::from_f32(vec![rows, 3], &lp).unwrap(),
        )
        .with_column(
            "prompt",
            (0..rows).map(|i| json!(format!("p{i}"))).collect(),
        )
}

#[test]
fn chunk_then_concat_is_identity() {
    let b = sample(7);
    let parts = b.chunk(3).unwrap();
    let sizes: Vec<usize> = parts.iter().map(|p| p.len().unwrap()).collect();
    assert_eq!(sizes, vec![3, 2, 2]);
    assert_eq!(parts[1].columns["prompt"][0], json!("p3"));
    assert_eq!(parts[1].tensors["input_ids"].to_i64().unwrap()[0], 9);
    assert_eq!(DataBatch::concat(&parts).unwrap(), b);
}

#[test]
fn pad_and_unpad() {
    let b = sample(5);
    let (p, pad) = b.pad_to_multiple(4).unwrap();
    assert_eq!((p.len().unwrap(), pad), (8, 3));
    assert_eq!(p.columns["prompt"][5], json!("p0"));
    assert_eq!(p.unpad(pad).unwrap(), b);
    assert_eq!(b.pad_to_multiple(5).unwrap().1, 0);
}

#[test]
fn inconsistent_rows_name_the_culprits() {
    let mut b = sample(4);
    b.columns.insert("extra".into(), vec![json!(1)]);
    let e = b.len().unwrap_err().to_string();
    assert!(e.contains("'extra' has 1"), "{e}");
    let e = TensorData::from_f32(vec![2, 2], &[1.0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs 16 bytes, got 4"), "{e}");
    let a = sample(2);
    let mut c = sample(2);
    c.tensors.insert(
        "logprobs".into(),
        TensorData::from_f32(vec![2, 4], &[0.0; 8]).unwrap(),
    );
    let e = DataBatch::concat(&[a, c]).unwrap_err().to_string();
    assert!(e.contains("'logprobs'") && e.contains("[2, 4]"), "{e}");
}

#[test]
fn encode_decode_and_stream_round_trip() {
    let mut b = sample(9);
    b.meta.insert("step".into(), json!(3));
    let bytes = encode(&b).unwrap();
    assert_eq!(decode(&bytes).unwrap(), b);
    let chunks = to_chunks(bytes.clone(), 100);
    assert!(chunks.len() > 3);
    let mut a = Assembler::new(1 << 20);
    for c in chunks.clone() {
        a.push(c).unwrap();
    }
    assert_eq!(a.finish().unwrap(), b);
    // Out of order, truncated, over the limit, corrupted: errors, never panics.
    let mut a = Assembler::new(1 << 20);
    assert!(a
        .push(chunks[1].clone())
        .unwrap_err()
        .to_string()
        .contains("expected 0"));
    let mut a = Assembler::new(1 << 20);
    a.push(chunks[0].clone()).unwrap();
    assert!(a
        .finish()
        .unwrap_err()
        .to_string()
        .contains("stream ended after"));
    let mut a = Assembler::new(10);
    assert!(a
        .push(chunks[0].clone())
        .unwrap_err()
        .to_string()
        .contains("over the 10 byte limit"));
    for cut in [0, 3, 15, 40, bytes.len() - 1] {
        assert!(decode(&bytes[..cut]).is_err());
    }
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert!(decode(&bad).is_err());
    // The checksum sees a single flipped bit, in the body or in the tail.
    let mut c = b.clone();
    let sum = checksum(&b);
    c.tensors.get_mut("logprobs").unwrap().data[5] ^= 1;
    assert_ne!(checksum(&c), sum);
    let mut c = b.clone();
    let d = &mut c.tensors.get_mut("input_ids").unwrap().data;
    let last = d.len() - 1;
    d[last] ^= 0x80;
    assert_ne!(checksum(&c), sum);
}

/// Odd byte counts everywhere: a U8 tensor of 7x13, an f32 tensor, an empty tensor and
/// a column, so chunk boundaries fall inside the header, inside tensors and on edges.
fn odd_batch() -> DataBatch {
    let u: Vec<u8> = (0..91u32).map(|i| (i * 37 % 251) as u8).collect();
    let f: Vec<f32> = (0..7 * 5).map(|i| i as f32 - 3.25).collect();
    DataBatch::new()
        .with_tensor(
            "a_bytes",
            TensorData::new(DType::U8, vec![7, 13], u).unwrap(),
        )
        .with_tensor("b_vals", TensorData::from_f32(vec![7, 5], &f).unwrap())
        .with_tensor(
            "c_empty",
            TensorData::new(DType::I64, vec![7, 0], Vec::new()).unwrap(),
        )
        .with_column("id", (0..7).map(|i| json!(i)).collect())
}

fn assemble(chunks: Vec<pb::BatchChunk>, max: u64) -> Result<(DataBatch, u64)> {
    let mut a = Assembler::new(max);
    for c in chunks {
        a.push(c)?;
    }
    a.finish_with_checksum()
}

#[test]
fn zero_copy_chunks_round_trip_at_every_size() {
    let b = odd_batch();
    let whole = encode(&b).unwrap();
    for size in [
        1,
        2,
        7,
        16,
        31,
        100,
        333,
        whole.len() - 1,
        whole.len(),
        1 << 20,
    ] {
        let chunks = encode_chunks(&b, size).unwrap();
        assert_eq!(chunks.len(), whole.len().div_ceil(size), "size {size}");
        let joined: Vec<u8> = chunks.iter().flat_map(|c| c.data.to_vec()).collect();
        assert_eq!(joined, whole, "size {size}");
        assert!(chunks.iter().all(|c| c.total_bytes == whole.len() as u64));
        let (got, sum) = assemble(chunks, 1 << 20).unwrap();
        assert_eq!(got, b, "size {size}");
        assert_eq!(sum, checksum(&b), "size {size}");
        // The old path gives the same chunks.
        let old: Vec<Vec<u8>> = to_chunks(whole.clone(), size)
            .into_iter()
            .map(|c| c.data.to_vec())
            .collect();
        let new: Vec<Vec<u8>> = encode_chunks(&b, size)
            .unwrap()
            .into_iter()
            .map(|c| c.data.to_vec())
            .collect();
        assert_eq!(old, new, "size {size}");
    }
}

#[test]
fn chunks_inside_a_tensor_share_its_storage() {
    let data: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let b = DataBatch::new().with_tensor("v", TensorData::from_f32(vec![64, 64], &data).unwrap());
    let t = &b.tensors["v"].data;
    let range = t.as_ptr() as usize..t.as_ptr() as usize + t.len();
    let chunks = encode_chunks(&b, 1000).unwrap();
    let inside = chunks
        .iter()
        .filter(|c| range.contains(&(c.data.as_ptr() as usize)))
        .count();
    // All but the chunk that carries the header (and the tail it copies) are views.
    assert!(inside >= chunks.len() - 2, "{inside} of {}", chunks.len());
    // Writing to the batch afterwards leaves the chunks as they were (copy-on-write).
    let mut c = b.clone();
    c.tensors.get_mut("v").unwrap().data[40_00] ^= 0xff;
    assert_eq!(assemble(chunks, 1 << 20).unwrap().0, b);
    assert_ne!(c, b);
}

#[test]
fn large_tensors_round_trip_through_prefaulted_buffers() {
    // Over PREFAULT_MIN and not a multiple of the prefault window or the page size.
    let n = (9 << 20) / 4 + 3;
    let v: Vec<f32> = (0..n).map(|i| (i % 7919) as f32 * 0.25).collect();
    let b = DataBatch::new()
        .with_tensor("big", TensorData::from_f32(vec![1, n], &v).unwrap())
        .with_tensor(
            "small",
            TensorData::new(DType::U8, vec![1, 5], vec![9; 5]).unwrap(),
        );
    for size in [CHUNK_BYTES, (1 << 20) + 7, 333_333] {
        let (got, sum) = assemble(encode_chunks(&b, size).unwrap(), 1 << 30).unwrap();
        assert_eq!(got.tensors["big"].to_f32().unwrap(), v, "chunks of {size}");
        assert_eq!(got, b);
        assert_eq!(sum, checksum(&b));
    }
}

#[test]
fn random_batches_round_trip_at_random_chunk_sizes() {
    // A small xorshift generator: deterministic, no dependency.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let dtypes = [DType::F32, DType::F64, DType::BF16, DType::I64, DType::U8];
    for case in 0..60 {
        let rows = next(9);
        let mut b = DataBatch::new();
        for k in 0..next(4) {
            let dtype = dtypes[next(dtypes.len())];
            let shape = vec![rows, next(40), 1 + next(3)];
            let len = shape.iter().product::<usize>() * dtype.size();
            let data = (0..len).map(|_| next(256) as u8).collect();
            b = b.with_tensor(
                &format!("t{k}"),
                TensorData::new(dtype, shape, data).unwrap(),
            );
        }
        if next(2) == 0 {
            b = b.with_column("c", (0..rows).map(|i| json!(i)).collect());
        }
        let whole = encode(&b).unwrap();
        let size = 1 + next(whole.len() + 10);
        let chunks = encode_chunks(&b, size).unwrap();
        let joined: Vec<u8> = chunks.iter().flat_map(|c| c.data.to_vec()).collect();
        assert_eq!(joined, whole, "case {case}");
        let (got, sum) = assemble(chunks, 1 << 20).unwrap();
        assert_eq!((got, sum), (b.clone(), checksum(&b)), "case {case}");
    }
}

#[test]
fn streamed_checksum_matches_for_any_split() {
    let b = odd_batch();
    let whole = encode(&b).unwrap();
    for piece in [1, 3, 32, 33, 64, 1000] {
        let mut d = Decoder::new(whole.len());
        for p in whole.chunks(piece) {
            d.feed(p).unwrap();
        }
        let (got, sum) = d.finish().unwrap();
        assert_eq!((got, sum), (b.clone(), checksum(&b)), "pieces of {piece}");
    }
    // A byte moved from the end of one tensor to the start of the next changes the sum.
    let x = DataBatch::new()
        .with_tensor(
            "a",
            TensorData::new(DType::U8, vec![3], vec![1, 2, 3]).unwrap(),
        )
        .with_tensor("b", TensorData::new(DType::U8, vec![1], vec![4]).unwrap());
    let y = DataBatch::new()
        .with_tensor(
            "a",
            TensorData::new(DType::U8, vec![2], vec![1, 2]).unwrap(),
        )
        .with_tensor(
            "b",
            TensorData::new(DType::U8, vec![2], vec![3, 4]).unwrap(),
        );
    assert_ne!(checksum(&x), checksum(&y));
}

#[test]
fn missing_corrupt_and_mismatched_chunks_are_clear_errors() {
    let b = odd_batch();
    let chunks = encode_chunks(&b, 50).unwrap();
    assert!(chunks.len() > 4);
    // A missing chunk.
    let mut gap = chunks.clone();
    gap.remove(2);
    let e = assemble(gap, 1 << 20).unwrap_err().to_string();
    assert!(e.contains("chunk 3 arrived, expected 2"), "{e}");
    // A lost last chunk.
    let mut short = chunks.clone();
    short.pop();
    let e = assemble(short, 1 << 20).unwrap_err().to_string();
    assert!(e.contains("stream ended after"), "{e}");
    // Chunks that disagree on the total.
    let mut odd = chunks.clone();
    odd[3].total_bytes += 1;
    let e = assemble(odd, 1 << 20).unwrap_err().to_string();
    assert!(
        e.contains("chunk 3 says") && e.contains("chunk 0 said"),
        "{e}"
    );
    // A total that does not match what the header describes, both ways.
    for delta in [-8i64, 8] {
        let mut wrong = chunks.clone();
        for c in &mut wrong {
            c.total_bytes = (c.total_bytes as i64 + delta) as u64;
        }
        let e = assemble(wrong, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("malformed batch encoding"), "{e}");
    }
    // A chunk with more bytes than announced.
    let mut big = chunks.clone();
    let last = big.len() - 1;
    let mut extra = big[last].data.to_vec();
    extra.extend_from_slice(&[0; 9]);
    big[last].data = extra.into();
    let e = assemble(big, 1 << 20).unwrap_err().to_string();
    assert!(
        e.contains("more bytes than the") && e.contains(&format!("chunk {last}")),
        "{e}"
    );
    // A corrupted header: wrong magic, and a broken JSON byte.
    let mut bad = chunks.clone();
    let mut d = bad[0].data.to_vec();
    d[1] = b'X';
    bad[0].data = d.into();
    let e = assemble(bad, 1 << 20).unwrap_err().to_string();
    assert!(e.contains("missing RLHB header"), "{e}");
    let mut bad = chunks.clone();
    let mut d = bad[0].data.to_vec();
    d[PREFIX] = b'#';
    bad[0].data = d.into();
    assert!(assemble(bad, 1 << 20).is_err());
    // A flipped bit in tensor bytes decodes, and the checksum says so.
    let mut bad = chunks.clone();
    let mut d = bad[last].data.to_vec();
    d[0] ^= 4;
    bad[last].data = d.into();
    let (got, sum) = assemble(bad, 1 << 20).unwrap();
    assert_ne!(got, b);
    assert_ne!(sum, checksum(&b));
    assert_eq!(sum, checksum(&got));
}

/// Hand-made encoding with a chosen header.
fn raw(header: serde_json::Value, body: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(body);
    out
}

#[test]
fn headers_that_lie_are_refused_before_allocating() {
    let t = |name: &str, shape: serde_json::Value, len: u64| json!({"name": name, "dtype": "u8", "shape": shape, "len": len});
    let h = |ts: Vec<serde_json::Value>| json!({"tensors": ts, "columns": {}, "meta": {}});
    // Length that disagrees with the shape names the tensor.
    let e = decode(&raw(h(vec![t("x", json!([4]), 3)]), &[0; 3]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor 'x'") && e.contains("needs 4 bytes"),
        "{e}"
    );
    // A terabyte tensor in a tiny stream fails on the header, not on allocation.
    let e = decode(&raw(h(vec![t("x", json!([1u64 << 40]), 1 << 40)]), &[0; 8]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensor 'x' runs past the end"), "{e}");
    // Shapes whose product overflows.
    let e = decode(&raw(h(vec![t("x", json!([u64::MAX, 4]), 4)]), &[0; 4]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than usize::MAX"), "{e}");
    // Trailing bytes after the tensors.
    let e = decode(&raw(h(vec![t("x", json!([2]), 2)]), &[0; 5]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 trailing bytes"), "{e}");
    // The same name twice.
    let e = decode(&raw(
        h(vec![t("x", json!([1]), 1), t("x", json!([1]), 1)]),
        &[0; 2],
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("'x' appears twice"), "{e}");
    // A header length past the end.
    let mut bytes = raw(h(vec![]), &[]);
    bytes[8] = 0xff;
    let e = decode(&bytes).unwrap_err().to_string();
    assert!(e.contains("runs past the end of a"), "{e}");
    // Tensors out of name order still decode, and the checksum is still `checksum`.
    let bytes = raw(
        h(vec![t("b", json!([1, 2]), 2), t("a", json!([1]), 1)]),
        &[1, 2, 3],
    );
    let mut a = Assembler::new(1 << 20);
    for c in to_chunks(bytes, 4) {
        a.push(c).unwrap();
    }
    let (got, sum) = a.finish_with_checksum().unwrap();
    assert_eq!(*got.tensors["b"].data, vec![1, 2]);
    assert_eq!(*got.tensors["a"].data, vec![3]);
    assert_eq!(sum, checksum(&got));
}

/// A tensor of no rows may carry any row shape, even one whose row size overflows (the wire
/// accepts it: its bytes are 0): selecting it stays empty, no overflow; a shape whose size
/// overflows is refused.
#[test]
fn a_rowless_tensor_with_a_huge_row_shape_selects_empty() {
    let t = TensorData::new(DType::F32, vec![0, 1 << 33, 1 << 33], vec![]).unwrap();
    let b = DataBatch::new().with_tensor("x", t);
    let picked = b.select(&[]).unwrap();
    assert_eq!(picked.tensors["x"].rows(), 0);
    assert!(picked.tensors["x"].data.is_empty());
    // As the wire decoder does: the size is computed from the first dimension on.
    assert!(TensorData::new(DType::F32, vec![1 << 33, 1 << 33, 0], vec![]).is_err());
    let e = TensorData::new(DType::F32, vec![2, 1 << 62], vec![]).unwrap_err();
    assert!(e.to_string().contains("more than usize::MAX"), "{e}");
}
