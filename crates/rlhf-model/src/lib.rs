//! Models on candle: Llama/Qwen2-family policy, value and score models.
