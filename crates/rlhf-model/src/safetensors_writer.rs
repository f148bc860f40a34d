//! A safetensors file written one tensor at a time: the header (every name, dtype, shape and
//! offset, listed up front) first, then each tensor's bytes in the listed order as they come.
//! A ZeRO-3 model's save streams its whole weights through it a layer at a time as the group
//! gathers them, so the rank that writes never holds the whole model. The file holds what
//! [`crate::weights::save_safetensors`] would write of the same tensors (the same header
//! entries and metadata, the same data), though not byte for byte: the data follows the
//! listed order and the header's keys are in serde_json's order, which readers do not
//! depend on.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};

/// An `f32` safetensors file being written ([`SafetensorsWriter::create`]).
pub struct SafetensorsWriter {
    out: BufWriter<File>,
    path: PathBuf,
    /// Every tensor: name and shape, in the order their bytes come.
    list: Vec<(String, Vec<usize>)>,
    next: usize,
}

impl SafetensorsWriter {
    /// Creates `path` (replacing it) with the header of `list` (`f32` tensors, by name and
    /// shape, in the order [`SafetensorsWriter::push_f32`] will give them), `{"format": "pt"}`
    /// and `metadata` in its metadata.
    pub fn create(
        path: &Path,
        list: Vec<(String, Vec<usize>)>,
        metadata: &[(&str, String)],
    ) -> Result<Self> {
        let mut meta = Map::new();
        meta.insert("format".into(), json!("pt"));
        for (k, v) in metadata {
            meta.insert((*k).to_string(), json!(v));
        }
        let mut header = Map::new();
        header.insert("__metadata__".into(), Value::Object(meta));
        let mut at = 0usize;
        for (name, shape) in &list {
            let bytes = shape.iter().product::<usize>() * 4;
            let entry = json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + bytes]});
            if header.insert(name.clone(), entry).is_some() || name == "__metadata__" {
                return Err(Error::InvalidArgument(format!(
                    "{}: the tensor name {name} is listed twice or reserved",
                    path.display()
                )));
            }
            at += bytes;
        }
        let mut text = serde_json::to_vec(&Value::Object(header)).map_err(|e| Error::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        // The data starts 8-byte aligned, as the safetensors library writes it.
        while text.len() % 8 != 0 {
            text.push(b' ');
        }
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&text))
            .map_err(|e| Error::io(path, e))?;
        Ok(Self {
            out,
            path: path.to_path_buf(),
            list,
            next: 0,
        })
    }

    /// Writes the next listed tensor's values.
    pub fn push_f32(&mut self, name: &str, data: &[f32]) -> Result<()> {
        let (listed, shape) = self.list.get(self.next).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}: {name} written after all {} listed tensors",
                self.path.display(),
                self.list.len()
            ))
        })?;
        if listed != name || shape.iter().product::<usize>() != data.len() {
            return Err(Error::InvalidArgument(format!(
                "{}: {name} ({} values) written where {listed} {shape:?} is listed",
                self.path.display(),
                data.len()
            )));
        }
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.out
            .write_all(&bytes)
            .map_err(|e| Error::io(&self.path, e))?;
        self.next += 1;
        Ok(())
    }

    /// Flushes the file once every listed tensor was written (not synced to disk: the
    /// checkpoint's publish does that).
    pub fn finish(self) -> Result<()> {
        if let Some((name, _)) = self.list.get(self.next) {
            return Err(Error::InvalidArgument(format!(
                "{}: the file ended before {name} ({} of {} tensors written)",
                self.path.display(),
                self.next,
                self.list.len()
            )));
        }
        let path = self.path;
        self.out
            .into_inner()
            .map_err(|e| Error::io(&path, e.into_error()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::SafetensorsWriter;
    use candle_core::{Device, Tensor};

    #[test]
    fn a_streamed_file_reads_back_as_the_tensors_and_refuses_misuse() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let a: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = vec![-1.0, 2.5, 3.25];
        let list = vec![("b".to_string(), vec![3]), ("a".to_string(), vec![2, 3])];
        let mut w = SafetensorsWriter::create(&path, list.clone(), &[("k", "v".into())]).unwrap();
        let err = w.push_f32("a", &a).unwrap_err().to_string();
        assert!(err.contains("where b [3] is listed"), "{err}");
        w.push_f32("b", &b).unwrap();
        w.push_f32("a", &a).unwrap();
        w.finish().unwrap();
        // The safetensors library checks the header and every offset.
        let (tensors, meta) = crate::weights::load_safetensors(&path, &Device::Cpu).unwrap();
        assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
        assert_eq!(meta.get("k").map(String::as_str), Some("v"));
        let got: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
            .iter()
            .map(|(n, t)| {
                let v = t.flatten_all().unwrap().to_vec1().unwrap();
                (n.clone(), t.dims().to_vec(), v)
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".into(), vec![2, 3], a.clone()),
                ("b".into(), vec![3], b.clone())
            ]
        );
        // The same bytes of tensor data as a whole-file save, and a file of equal size.
        let whole = dir.path().join("whole.safetensors");
        let t = |v: &[f32], s: &[usize]| Tensor::from_vec(v.to_vec(), s, &Device::Cpu).unwrap();
        crate::weights::save_safetensors_with_metadata(
            &[("a".into(), t(&a, &[2, 3])), ("b".into(), t(&b, &[3]))],
            &[("k", "v".into())],
            &whole,
        )
        .unwrap();
        let len = |p: &std::path::Path| std::fs::metadata(p).unwrap().len();
        let header = |p: &std::path::Path| {
            let bytes = std::fs::read(p).unwrap();
            u64::from_le_bytes(bytes[..8].try_into().unwrap())
        };
        assert_eq!(len(&path) - header(&path), len(&whole) - header(&whole));

        let mut w = SafetensorsWriter::create(&path, list, &[]).unwrap();
        w.push_f32("b", &b).unwrap();
        let err = w.finish().err().unwrap().to_string();
        assert!(err.contains("ended before a"), "{err}");
    }
}
