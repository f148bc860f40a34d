//! The element type of a tensor as it travels: a tag, the data is always bytes.

use serde::{Deserialize, Serialize};

/// Element type of a tensor on the wire and in weight syncs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    U32,
    U8,
}

impl DType {
    /// Every element type.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::U32,
        DType::U8,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Lower-case name, as in safetensors headers and the batch encoding.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
        }
    }

    /// A stable number per type, for hashes and headers (never reused).
    pub fn tag(self) -> u64 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::BF16 => 3,
            DType::F16 => 4,
            DType::U8 => 5,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::U32 => 8,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_tags_and_serde_agree() {
        let mut tags = std::collections::BTreeSet::new();
        for d in DType::ALL {
            assert!(tags.insert(d.tag()), "tag of {d} reused");
            assert_eq!(
                serde_json::to_string(&d).unwrap(),
                format!("\"{}\"", d.name())
            );
            assert!(matches!(d.size(), 1 | 2 | 4 | 8));
        }
    }
}

/// f32 values from their little-endian bytes (the wire's and safetensors' order); `None` when
/// the length is not a whole number of values.
pub fn f32s_from_le_bytes(bytes: &[u8]) -> Option<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    )
}

#[cfg(test)]
mod bytes_tests {
    use super::f32s_from_le_bytes;

    #[test]
    fn f32s_round_trip_and_partial_values_are_refused() {
        let v = [1.5f32, -0.0, f32::MAX, 3.25e-7];
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(f32s_from_le_bytes(&bytes).unwrap(), v);
        assert_eq!(f32s_from_le_bytes(&bytes[..7]), None);
        assert_eq!(f32s_from_le_bytes(&[]).unwrap(), Vec::<f32>::new());
    }
}
