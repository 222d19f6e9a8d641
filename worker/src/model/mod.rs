//! Models the stages run, on candle (CPU; CUDA comes with the `cuda` feature in a later step).

pub mod drafter;
pub mod qwen3;
