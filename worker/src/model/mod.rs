//! Models the stages run, on candle (CPU; CUDA comes with the `cuda` feature in a later step).

pub mod drafter;
pub mod qwen3;

use candle_core::{D, DType, Tensor};

/// The second half of the last axis, negated, then the first half: the rotation of rotary
/// embeddings as Qwen3 (and `transformers`) apply it.
pub(crate) fn rotate_half(x: &Tensor) -> candle_core::Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// The largest absolute difference between two tensors of one shape, in f32 (what the tests and
/// the parity checks compare).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()
}
