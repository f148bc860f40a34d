//! PPO algorithm core: pure, synchronous math over candle tensors with masks.
