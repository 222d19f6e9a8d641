//! Speculative sampling: the distribution a token is drawn from at a temperature (with top-k
//! and top-p truncation, as the official DFlash package defines them), a draw from it, and the
//! verification of drafted tokens by rejection sampling, which keeps the output distributed
//! exactly as the target's own sampling (Leviathan et al. 2023; Chen et al. 2023).
//!
//! A drafted token `x` at a position where the target gives `p` and the drafter drew `x` from
//! `q` is accepted with probability `min(1, p(x) / q(x))`; at the first rejection the token is
//! drawn from the residual `max(p − q, 0)` normalised (from `p` itself when that is all zero),
//! and when every drafted token is accepted one more is drawn from the target's next `p`.

use dflash_common::eval::Sampling;

use crate::rng::SplitMix64;

/// A uniform draw in `[0, 1)`.
pub fn uniform(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// The distribution `logits` (one row) give at `s`: softmax(logits / T) over the `top_k` largest
/// (all when 0 or at least the vocabulary), then the smallest head of tokens, in falling order,
/// whose mass reaches `top_p` (a token is kept when the mass before it is below `top_p`),
/// renormalised. Computed in f64; a row whose values are not finite is refused.
pub fn probabilities(logits: &[f32], s: &Sampling) -> Result<Vec<f64>, String> {
    if logits.is_empty() {
        return Err("an empty row of logits".into());
    }
    if let Some(bad) = logits.iter().find(|l| !l.is_finite()) {
        return Err(format!(
            "the logits hold a non-finite value ({bad}): cannot sample"
        ));
    }
    let t = s.temperature;
    let n = logits.len();
    // Indices by falling logit, ties by index: the order truncation keeps tokens in.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let keep = if s.top_k == 0 || s.top_k as usize >= n {
        n
    } else {
        s.top_k as usize
    };
    order.truncate(keep);
    let max = f64::from(logits[order[0]]) / t;
    let mut kept: Vec<(usize, f64)> = order
        .iter()
        .map(|&i| (i, (f64::from(logits[i]) / t - max).exp()))
        .collect();
    let total: f64 = kept.iter().map(|(_, w)| w).sum();
    for (_, w) in &mut kept {
        *w /= total;
    }
    if s.top_p < 1.0 {
        let mut before = 0.0;
        let mut cut = kept.len();
        for (j, (_, w)) in kept.iter().enumerate() {
            if before >= s.top_p {
                cut = j;
                break;
            }
            before += w;
        }
        kept.truncate(cut.max(1));
        let total: f64 = kept.iter().map(|(_, w)| w).sum();
        for (_, w) in &mut kept {
            *w /= total;
        }
    }
    let mut probs = vec![0.0; n];
    for (i, w) in kept {
        probs[i] = w;
    }
    Ok(probs)
}

/// A draw from `probs` (non-negative, summing to about 1): the first index whose cumulative
/// mass passes a uniform draw; rounding that leaves the draw past the total gives the last
/// index of positive mass.
pub fn draw(probs: &[f64], rng: &mut SplitMix64) -> u32 {
    let total: f64 = probs.iter().sum();
    let mut u = uniform(rng) * total;
    let mut last = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            if u < p {
                return i as u32;
            }
            u -= p;
            last = i;
        }
    }
    last as u32
}

/// What a drafted token was drawn from.
#[derive(Debug, Clone, PartialEq)]
pub enum Proposal {
    /// Chosen deterministically (probability 1): a greedy or rule-based proposer.
    Point,
    /// Drawn from this distribution over the vocabulary.
    Drawn(Vec<f64>),
}

impl Proposal {
    /// The probability the proposer gave `token`.
    fn of(&self, token: u32) -> f64 {
        match self {
            Self::Point => 1.0,
            Self::Drawn(q) => q.get(token as usize).copied().unwrap_or(0.0),
        }
    }
}

/// Verifies `drafted` (each drawn from its `proposals` entry) against the target's distributions
/// `target` (one per drafted token, then one for the token after them): the number accepted, and
/// the token that follows them (from the residual at the first rejection, else from the last
/// distribution). `target` must have `drafted.len() + 1` rows.
pub fn verify(
    drafted: &[u32],
    proposals: &[Proposal],
    target: &[Vec<f64>],
    rng: &mut SplitMix64,
) -> Result<(usize, u32), String> {
    if proposals.len() != drafted.len() || target.len() != drafted.len() + 1 {
        return Err(format!(
            "{} drafted tokens with {} proposals and {} target rows",
            drafted.len(),
            proposals.len(),
            target.len()
        ));
    }
    for (i, (&x, q)) in drafted.iter().zip(proposals).enumerate() {
        let p = target[i].get(x as usize).copied().unwrap_or(0.0);
        let qx = q.of(x);
        // Accept with probability min(1, p / q), as `u·q < p`.
        if uniform(rng) * qx < p {
            continue;
        }
        let mut residual = target[i].clone();
        match q {
            Proposal::Point => {
                if let Some(r) = residual.get_mut(x as usize) {
                    *r = (*r - 1.0).max(0.0);
                }
            }
            Proposal::Drawn(q) => {
                for (r, &qi) in residual.iter_mut().zip(q) {
                    *r = (*r - qi).max(0.0);
                }
            }
        }
        let next = if residual.iter().sum::<f64>() > 0.0 {
            draw(&residual, rng)
        } else {
            draw(&target[i], rng)
        };
        return Ok((i, next));
    }
    Ok((drafted.len(), draw(&target[drafted.len()], rng)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(temperature: f64, top_p: f64, top_k: u32) -> Sampling {
        Sampling {
            temperature,
            top_p,
            top_k,
            seed: 0,
        }
    }

    #[test]
    fn probabilities_follow_the_temperature_and_the_truncations() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let soft = |t: f64, kept: &[usize]| {
            let w: Vec<f64> = kept
                .iter()
                .map(|&i| (f64::from(logits[i]) / t).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let mut p = vec![0.0; 4];
            for (&i, w) in kept.iter().zip(w) {
                p[i] = w / total;
            }
            p
        };
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12);
        assert!(close(
            &probabilities(&logits, &at(1.0, 1.0, 0)).unwrap(),
            &soft(1.0, &[0, 1, 2, 3])
        ));
        assert!(close(
            &probabilities(&logits, &at(0.5, 1.0, 0)).unwrap(),
            &soft(0.5, &[0, 1, 2, 3])
        ));
        assert!(close(
            &probabilities(&logits, &at(1.0, 1.0, 2)).unwrap(),
            &soft(1.0, &[0, 1])
        ));
        // top-k at or past the vocabulary keeps everything.
        assert!(close(
            &probabilities(&logits, &at(1.0, 1.0, 9)).unwrap(),
            &soft(1.0, &[0, 1, 2, 3])
        ));
        // Softmax at T 1: 0.644, 0.237, 0.087, 0.032. top-p 0.8 keeps the first two (the mass
        // before the second is 0.644 < 0.8; before the third 0.881 ≥ 0.8).
        assert!(close(
            &probabilities(&logits, &at(1.0, 0.8, 0)).unwrap(),
            &soft(1.0, &[0, 1])
        ));
        // A tiny top-p keeps the most likely token alone.
        assert_eq!(
            probabilities(&logits, &at(1.0, 1e-9, 0)).unwrap(),
            vec![1.0, 0.0, 0.0, 0.0]
        );
        assert!(probabilities(&[1.0, f32::NAN], &at(1.0, 1.0, 0)).is_err());
        assert!(probabilities(&[], &at(1.0, 1.0, 0)).is_err());
    }

    #[test]
    fn draws_follow_the_distribution() {
        let probs = [0.5, 0.0, 0.3, 0.2];
        let mut rng = SplitMix64(11);
        let mut counts = [0u32; 4];
        let n = 200_000;
        for _ in 0..n {
            counts[draw(&probs, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[1], 0);
        for (c, p) in counts.iter().zip(probs) {
            // Five standard deviations of a binomial count.
            let sd = (f64::from(n) * p * (1.0 - p)).sqrt();
            assert!(
                (f64::from(*c) - f64::from(n) * p).abs() <= 5.0 * sd + 1.0,
                "{counts:?}"
            );
        }
    }

    /// One drafted token then the bonus: the first output token's distribution is the target's
    /// `p`, whatever `q` the token was drawn from, and the second follows the target's next row.
    #[test]
    fn rejection_sampling_keeps_the_targets_distribution() {
        let p = vec![0.1, 0.6, 0.3, 0.0];
        let after = vec![0.25, 0.25, 0.25, 0.25];
        let q = vec![0.4, 0.1, 0.1, 0.4];
        let n = 200_000u32;
        for proposal in [Some(q.clone()), None] {
            let mut rng = SplitMix64(5);
            let mut first = [0u32; 4];
            let mut accepted = 0;
            for _ in 0..n {
                let (x, prop) = match &proposal {
                    Some(q) => (draw(q, &mut rng), Proposal::Drawn(q.clone())),
                    // A point proposal of token 3, which the target never emits.
                    None => (3, Proposal::Point),
                };
                let (a, next) =
                    verify(&[x], &[prop], &[p.clone(), after.clone()], &mut rng).unwrap();
                first[if a == 1 { x } else { next } as usize] += 1;
                accepted += a;
            }
            for (c, want) in first.iter().zip(&p) {
                let sd = (f64::from(n) * want * (1.0 - want)).sqrt();
                assert!(
                    (f64::from(*c) - f64::from(n) * want).abs() <= 5.0 * sd + 1.0,
                    "{first:?}"
                );
            }
            // Acceptance is Σ min(p, q) = 0.1 + 0.1 + 0.1 = 0.3 for the drawn proposal, 0 for
            // the point proposal of a token the target never emits.
            let rate = accepted as f64 / f64::from(n);
            let want = if proposal.is_some() { 0.3 } else { 0.0 };
            assert!((rate - want).abs() < 0.01, "{rate}");
        }
        assert!(verify(&[1], &[], &[p.clone(), after], &mut SplitMix64(0)).is_err());
    }
}
