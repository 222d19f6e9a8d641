//! The drafter's optimiser: AdamW with linear warmup then cosine decay, gradient clipping (the norm
//! is reported) and accumulation over micro-batches.
//!
//! AdamW is written here rather than taken from candle-nn because its moments must go into
//! checkpoints, and candle-nn keeps them private: a resumed run would restart them from zero and no
//! longer match an uninterrupted one.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

/// Gradients of the optimiser's variables, in their order (`None`: no gradient).
pub type Grads = Vec<Option<Tensor>>;

/// The gradients of `vars` from a backward pass.
pub fn grads_of(store: &GradStore, vars: &[Var]) -> Grads {
    vars.iter()
        .map(|v| store.get(v.as_tensor()).cloned())
        .collect()
}

/// Adds `more` to the gradients in `into` (a missing one counts as zero).
pub fn add_grads(into: &mut Option<Grads>, more: Grads) -> candle_core::Result<()> {
    *into = Some(match into.take() {
        None => more,
        Some(sum) => sum
            .into_iter()
            .zip(more)
            .map(|pair| match pair {
                (Some(a), Some(b)) => Ok(Some((a + b)?)),
                (a, b) => Ok(a.or(b)),
            })
            .collect::<candle_core::Result<Grads>>()?,
    });
    Ok(())
}

/// Learning rate: linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to 0 at
/// `total` steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub peak: f64,
    pub warmup: u64,
    pub total: u64,
}

impl Schedule {
    /// The rate for optimiser step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let done = (step - self.warmup).min(span) as f64 / span as f64;
        self.peak * 0.5 * (1.0 + (std::f64::consts::PI * done).cos())
    }
}

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW over a list of variables, with state that can be saved and restored.
pub struct AdamW {
    pub config: AdamWConfig,
    pub vars: Vec<Var>,
    /// First and second moments, one pair per variable.
    pub moments: Vec<(Tensor, Tensor)>,
    /// Steps taken.
    pub t: u64,
}

impl AdamW {
    pub fn new(vars: Vec<Var>, config: AdamWConfig) -> candle_core::Result<Self> {
        let moments = vars
            .iter()
            .map(|v| Ok((v.zeros_like()?, v.zeros_like()?)))
            .collect::<candle_core::Result<_>>()?;
        Ok(Self {
            config,
            vars,
            moments,
            t: 0,
        })
    }

    /// One update with learning rate `lr` from `grads` (aligned with `vars`; variables without a
    /// gradient are left as they are).
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64) -> candle_core::Result<()> {
        self.t += 1;
        let c = self.config;
        let bias1 = 1.0 - c.beta1.powi(self.t as i32);
        let bias2 = 1.0 - c.beta2.powi(self.t as i32);
        for ((var, (m, v)), g) in self.vars.iter().zip(&mut self.moments).zip(grads) {
            let Some(g) = g else {
                continue;
            };
            *m = ((&*m * c.beta1)? + (g * (1.0 - c.beta1))?)?;
            *v = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let m_hat = (&*m / bias1)?;
            let v_hat = (&*v / bias2)?;
            let update = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
            let decayed = (var.as_tensor() * (1.0 - lr * c.weight_decay))?;
            var.set(&(decayed - (update * lr)?)?)?;
        }
        Ok(())
    }
}

/// Global L2 norm of gradients.
pub fn grad_norm(grads: &[Option<Tensor>]) -> candle_core::Result<f64> {
    let mut sum = 0f64;
    for g in grads.iter().flatten() {
        sum += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
    }
    Ok(sum.sqrt())
}

/// Scales gradients so their global norm is at most `max_norm`; returns the norm before.
pub fn clip_grad_norm(grads: &mut [Option<Tensor>], max_norm: f64) -> candle_core::Result<f64> {
    let norm = grad_norm(grads)?;
    if norm > max_norm && norm > 0.0 {
        let scale = max_norm / norm;
        for g in grads.iter_mut().flatten() {
            *g = (&*g * scale)?;
        }
    }
    Ok(norm)
}

/// Sums gradients of micro-batches (each scaled by `1 / accum`) until an optimiser step.
#[derive(Default)]
pub struct Accumulator {
    grads: Option<Grads>,
    pub micro: usize,
}

impl Accumulator {
    /// Adds the gradients of one micro-batch loss, scaled by `1 / accum`.
    pub fn add(&mut self, loss: &Tensor, vars: &[Var], accum: usize) -> candle_core::Result<()> {
        self.sum(grads_of(&(loss / accum as f64)?.backward()?, vars))?;
        self.micro += 1;
        Ok(())
    }

    /// Adds gradients already scaled (part of a micro-batch; the caller counts `micro`).
    pub fn sum(&mut self, grads: Grads) -> candle_core::Result<()> {
        add_grads(&mut self.grads, grads)
    }

    /// The summed gradients, resetting the accumulator.
    pub fn take(&mut self) -> Option<Grads> {
        self.micro = 0;
        self.grads.take()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn schedule_warms_up_then_decays() {
        let s = Schedule {
            peak: 6e-4,
            warmup: 4,
            total: 104,
        };
        assert!((s.lr(0) - 1.5e-4).abs() < 1e-12);
        assert!((s.lr(3) - 6e-4).abs() < 1e-12);
        assert!((s.lr(4) - 6e-4).abs() < 1e-12);
        assert!((s.lr(54) - 3e-4).abs() < 1e-9);
        assert!(s.lr(104) < 1e-12);
        assert!(s.lr(500) < 1e-12);
    }

    #[test]
    fn adamw_matches_the_formula() {
        let dev = Device::Cpu;
        let var = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &dev).unwrap()).unwrap();
        let mut opt = AdamW::new(vec![var.clone()], AdamWConfig::default()).unwrap();
        let loss = (var.as_tensor().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
        let grads = grads_of(&loss.backward().unwrap(), std::slice::from_ref(&var));
        opt.step(&grads, 0.1).unwrap();
        // First step: m_hat = g, v_hat = g^2, update = g / (|g| + eps) = sign(g).
        let got = var.as_tensor().to_vec1::<f32>().unwrap();
        let want = [
            1.0 * (1.0 - 0.1 * 0.01) - 0.1,
            -2.0 * (1.0 - 0.1 * 0.01) + 0.1,
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w as f32).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        assert_eq!(opt.t, 1);
    }

    #[test]
    fn clipping_caps_the_norm_and_reports_it() {
        let dev = Device::Cpu;
        let var = Var::from_tensor(&Tensor::new(&[3.0f32, 4.0], &dev).unwrap()).unwrap();
        let loss = (var.as_tensor().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
        let mut grads = grads_of(&loss.backward().unwrap(), std::slice::from_ref(&var));
        let norm = clip_grad_norm(&mut grads, 1.0).unwrap();
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((grad_norm(&grads).unwrap() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn accumulation_averages_micro_batches() {
        let dev = Device::Cpu;
        let var = Var::from_tensor(&Tensor::new(&[2.0f32], &dev).unwrap()).unwrap();
        let vars = [var.clone()];
        let mut acc = Accumulator::default();
        for scale in [1.0, 3.0] {
            let loss = (var.as_tensor().sum_all().unwrap() * scale).unwrap();
            acc.add(&loss, &vars, 2).unwrap();
        }
        assert_eq!(acc.micro, 2);
        let grads = acc.take().unwrap();
        let g = grads[0].as_ref().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(g, vec![2.0]);
        assert!(acc.take().is_none());
    }
}
