//! Greedy and speculative decoding on the tiny target: plain decoding with the KV cache equals
//! the argmax of full recomputation; speculative decoding gives the same tokens whatever the
//! drafter proposes, accepts exactly the proposal's agreeing prefix plus one, and hands the
//! drafter the target's hidden states of exactly the verified positions.

use std::path::Path;

use candle_core::{D, DType, Device, Tensor};
use dflash_e2e::{hidden_states_alone, orch};
use dflash_worker::model::drafter::{Drafter, DrafterConfig, Heads};
use dflash_worker::model::qwen3::{Qwen3, load_heads};
use dflash_worker::speculative::{Draft, Proposer, Target, load_drafter};

fn tiny(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("tiny");
    let o = orch(&["init-tiny", "--output", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

struct Fixture {
    model: Qwen3,
    embedding: Tensor,
    lm_head: Tensor,
}

fn fixture(dir: &Path) -> Fixture {
    let path = tiny(dir);
    let model = Qwen3::load(&path, None, &Device::Cpu, DType::F32).unwrap();
    let (embedding, lm_head) = load_heads(&path, &Device::Cpu, DType::F32).unwrap();
    Fixture {
        model,
        embedding,
        lm_head,
    }
}

/// Greedy decoding the slow way: the whole sequence recomputed for every new token.
fn greedy_by_recomputation(f: &Fixture, prompt: &[u32], new: usize) -> Vec<u32> {
    let full = f.model.config.num_hidden_layers;
    let mut seq = prompt.to_vec();
    for _ in 0..new {
        let last = hidden_states_alone(&f.model, &seq, &[full]).pop().unwrap();
        let logits = last
            .narrow(0, seq.len() - 1, 1)
            .unwrap()
            .matmul(&f.lm_head.t().unwrap())
            .unwrap();
        seq.push(logits.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap()[0]);
    }
    seq.split_off(prompt.len())
}

fn prompt(len: usize, seed: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 37 + seed * 11 + 5) % 590) as u32)
        .collect()
}

#[test]
fn plain_greedy_decoding_equals_full_recomputation() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(dir.path());
    let target = Target {
        model: &f.model,
        lm_head: &f.lm_head,
    };
    for (len, new) in [(1, 5), (7, 12), (20, 1)] {
        let p = prompt(len, len);
        let got = target.generate(None, &p, new, &[]).unwrap();
        assert_eq!(
            got.output_ids,
            greedy_by_recomputation(&f, &p, new),
            "{len}"
        );
        // One token per verify step, the prefill's token not counted.
        assert_eq!(got.acceptance, vec![1; new - 1]);
    }
    assert!(target.generate(None, &[], 4, &[]).is_err());
    assert!(
        target
            .generate(None, &prompt(3, 0), 0, &[])
            .unwrap()
            .output_ids
            .is_empty()
    );
}

/// A proposer that knows the greedy continuation and gets the first `right[step]` draft tokens
/// of each block right and the rest wrong; it checks every feature row it is handed against the
/// target's hidden states of the full greedy sequence at that position.
struct Oracle {
    block: usize,
    layers: Vec<usize>,
    /// The prompt then the greedy continuation.
    sequence: Vec<u32>,
    /// The features of `sequence` recomputed from scratch `[len, width]`.
    expected: Tensor,
    right: Vec<usize>,
    step: usize,
    /// Positions whose features have been handed over, in order.
    seen: usize,
    vocab: u32,
}

impl Oracle {
    fn check(&mut self, features: &Tensor, offset: usize) -> Result<(), String> {
        assert_eq!(offset, self.seen, "features must arrive in order, once");
        let n = features.dim(0).unwrap();
        let want = self.expected.narrow(0, offset, n).unwrap();
        let diff = dflash_worker::model::max_abs_diff(features, &want).unwrap();
        assert!(diff < 1e-4, "features at {offset}..{}: {diff}", offset + n);
        self.seen += n;
        Ok(())
    }
}

impl Proposer for Oracle {
    fn block_size(&self) -> usize {
        self.block
    }
    fn mask_token(&self) -> u32 {
        1
    }
    fn target_layer_ids(&self) -> &[usize] {
        &self.layers
    }
    fn start(&mut self, features: &Tensor) -> Result<(), String> {
        self.seen = 0;
        self.check(features, 0)
    }
    fn extend(&mut self, features: &Tensor, offset: usize) -> Result<(), String> {
        self.check(features, offset)
    }
    fn propose(&mut self, token: u32, position: usize, b: usize) -> Result<Vec<u32>, String> {
        assert_eq!(
            token, self.sequence[position],
            "the block starts at the last token"
        );
        assert_eq!(
            position, self.seen,
            "every position before the block is known"
        );
        let right = self.right[self.step % self.right.len()];
        self.step += 1;
        Ok((1..b)
            .map(|k| {
                let truth = self.sequence.get(position + k).copied().unwrap_or(0);
                if k <= right {
                    truth
                } else {
                    (truth + 1) % self.vocab
                }
            })
            .collect())
    }
}

#[test]
fn speculative_decoding_accepts_the_agreeing_prefix_plus_one_and_stays_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(dir.path());
    let target = Target {
        model: &f.model,
        lm_head: &f.lm_head,
    };
    let layers = vec![0, 2];
    let indices: Vec<usize> = layers.iter().map(|l| l + 1).collect();
    let p = prompt(9, 3);
    let new = 30;
    let greedy = target.generate(None, &p, new, &[]).unwrap().output_ids;
    let sequence: Vec<u32> = p.iter().chain(&greedy).copied().collect();
    let expected = Tensor::cat(
        &hidden_states_alone(&f.model, &sequence, &indices),
        D::Minus1,
    )
    .unwrap();
    for (block, right) in [
        (4, vec![0, 1, 2, 3]),
        (5, vec![4, 4, 0, 2]),
        (16, vec![15]),
        (2, vec![1, 0]),
    ] {
        let mut oracle = Oracle {
            block,
            layers: layers.clone(),
            sequence: sequence.clone(),
            expected: expected.clone(),
            right: right.clone(),
            step: 0,
            seen: 0,
            vocab: 600,
        };
        let got = target.generate(Some(&mut oracle), &p, new, &[]).unwrap();
        assert_eq!(got.output_ids, greedy, "block {block}: lossless");
        // Each step gains the agreeing prefix plus one, capped by the tokens left.
        let mut left = new - 1;
        let want: Vec<u32> = (0..)
            .map_while(|step| {
                if left == 0 {
                    return None;
                }
                let gained = (right[step % right.len()] + 1).min(left);
                left -= gained;
                Some(gained as u32)
            })
            .collect();
        assert_eq!(got.acceptance, want, "block {block}");
        assert_eq!(
            got.acceptance.iter().sum::<u32>() as usize + 1,
            got.output_ids.len()
        );
    }
    // A stop token ends the output right after it, in the middle of an accepted block.
    let stop = greedy[11];
    let first = greedy.iter().position(|&t| t == stop).unwrap();
    let mut oracle = Oracle {
        block: 8,
        layers: layers.clone(),
        sequence: sequence.clone(),
        expected: expected.clone(),
        right: vec![7],
        step: 0,
        seen: 0,
        vocab: 600,
    };
    let got = target
        .generate(Some(&mut oracle), &p, new, &[stop])
        .unwrap();
    assert_eq!(got.output_ids, greedy[..=first].to_vec());
    assert_eq!(
        target.generate(None, &p, new, &[stop]).unwrap().output_ids,
        greedy[..=first].to_vec()
    );
}

fn drafter_for(f: &Fixture, layers: Vec<usize>, seed: u64) -> Drafter {
    let c = &f.model.config;
    Drafter::new(
        DrafterConfig::for_target(c, 1, 8, 3, layers),
        seed,
        &Device::Cpu,
    )
    .unwrap()
}

#[test]
fn speculative_decoding_with_a_drafter_is_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(dir.path());
    let target = Target {
        model: &f.model,
        lm_head: &f.lm_head,
    };
    let drafter = drafter_for(&f, vec![1, 3], 7);
    for (len, new, block) in [(5, 40, 8), (12, 17, 4), (1, 9, 16)] {
        let p = prompt(len, new);
        let greedy = target.generate(None, &p, new, &[]).unwrap();
        let mut draft = Draft::new(
            &drafter,
            Heads {
                embedding: &f.embedding,
                lm_head: &f.lm_head,
            },
            block,
        );
        let spec = target.generate(Some(&mut draft), &p, new, &[]).unwrap();
        assert_eq!(
            spec.output_ids, greedy.output_ids,
            "prompt {len}, block {block}"
        );
        assert_eq!(spec.output_ids.len(), new);
        assert!(
            spec.acceptance
                .iter()
                .all(|&a| a >= 1 && a as usize <= block)
        );
    }
}

/// A checkpoint's drafter loads back exactly; a checkpoint with a tensor missing, an unknown
/// tensor or a tensor of the wrong shape is refused, naming it.
#[test]
fn drafter_checkpoints_load_back_and_bad_ones_are_named() {
    use dflash_worker::checkpoint;
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(dir.path());
    let drafter = drafter_for(&f, vec![1, 2], 11);
    let save = |weights: Vec<(String, Vec<usize>, Vec<f32>)>, name: &str| {
        let root = dir.path().join(name);
        let snapshot = checkpoint::Snapshot {
            state: checkpoint::TrainingState::default(),
            moments: weights
                .iter()
                .map(|(n, s, v)| (n.clone(), s.clone(), v.clone(), v.clone()))
                .collect(),
            weights,
            config: checkpoint::hf_config(&drafter.config, &f.model.config),
            written: None,
        };
        checkpoint::save(&root, &snapshot, 1).unwrap()
    };
    let weights = checkpoint::weights(&drafter).unwrap();
    let good = save(weights.clone(), "good");
    let loaded = load_drafter(&good, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(loaded.config, drafter.config);
    for (a, b) in loaded.params.iter().zip(&drafter.params) {
        let diff = dflash_worker::model::max_abs_diff(a.var.as_tensor(), b.var.as_tensor());
        assert_eq!(diff.unwrap(), 0.0, "{}", a.name);
    }

    let mut missing = weights.clone();
    let gone = missing.remove(3).0;
    let err = load_drafter(&save(missing, "missing"), &Device::Cpu, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(&gone), "{err}");

    let mut extra = weights.clone();
    extra.push((
        "layers.9.mlp.up_proj.weight".into(),
        vec![2],
        vec![0.0, 1.0],
    ));
    let err = load_drafter(&save(extra, "extra"), &Device::Cpu, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("layers.9.mlp.up_proj.weight"), "{err}");

    let mut wrong = weights;
    wrong[0].1 = vec![wrong[0].2.len()];
    let err = load_drafter(&save(wrong, "wrong"), &Device::Cpu, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("shape"), "{err}");
}
