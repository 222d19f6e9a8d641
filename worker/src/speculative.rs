//! Greedy decoding by the target alone and with a DFlash drafter (speculative decoding), as the
//! official DFlash code runs it, and the drafter loaded from a checkpoint directory.
//!
//! One step of speculative decoding: the drafter fills the block `[last token, MASK × (B − 1)]` in
//! one pass, seeing the target's hidden states (at `target_layer_ids`) of every token before the
//! block; one target pass verifies the block; the longest prefix of draft tokens that equals the
//! target's own greedy choices is accepted, plus the target's next token after it. The step gains
//! `accepted + 1` tokens (capped by the token limit and cut after a stop token). Greedy
//! acceptance keeps the output equal to plain greedy decoding by the target, token for token (up
//! to float rounding between a block pass and single-token passes).

use std::path::Path;
use std::time::Instant;

use candle_core::{D, DType, Device, Tensor};
use dflash_common::eval::{DraftConfig, Sampling};

use crate::model::drafter::{Drafter, DrafterConfig, Heads};
use crate::model::qwen3::{KvCache, ModelError, Qwen3};
use crate::rng::SplitMix64;
use crate::sampling::{Proposal, draw, probabilities};

/// The target with its output head, ready to decode.
pub struct Target<'a> {
    pub model: &'a Qwen3,
    /// `[vocab, hidden]`, in the model's dtype.
    pub lm_head: &'a Tensor,
}

/// What proposes the tokens of a block: the DFlash drafter, or a test's oracle.
pub trait Proposer {
    /// Tokens per block (drafted and verified per step).
    fn block_size(&self) -> usize;
    /// The token that fills the undrafted positions of a block.
    fn mask_token(&self) -> u32;
    /// The target layers whose hidden states the proposer reads (layer id k: hidden state k + 1).
    fn target_layer_ids(&self) -> &[usize];
    /// Starts a prompt: `features` (`[n, width]`) of its positions `0..n`.
    fn start(&mut self, features: &Tensor) -> Result<(), String>;
    /// Adds the features of the accepted positions `offset..offset + n`.
    fn extend(&mut self, features: &Tensor, offset: usize) -> Result<(), String>;
    /// The `b - 1` tokens after `token` at `position`, every position before it known.
    fn propose(&mut self, token: u32, position: usize, b: usize) -> Result<Vec<u32>, String>;
    /// [`Proposer::propose`] when sampling at `sampling`: the tokens and what each was drawn
    /// from. A proposer that chooses its tokens deterministically keeps this default (each a
    /// [`Proposal::Point`]), and rejection sampling stays exact for it.
    fn propose_sampled(
        &mut self,
        token: u32,
        position: usize,
        b: usize,
        _sampling: &Sampling,
        _rng: &mut SplitMix64,
    ) -> Result<(Vec<u32>, Vec<Proposal>), String> {
        let tokens = self.propose(token, position, b)?;
        let points = vec![Proposal::Point; tokens.len()];
        Ok((tokens, points))
    }
}

/// The DFlash drafter with what it borrows from the target, and its context of the prompt
/// being decoded (keys and values per drafter layer, extended as tokens are accepted).
pub struct Draft<'a> {
    pub drafter: &'a Drafter,
    /// The target's embedding and output head.
    pub heads: Heads<'a>,
    /// Tokens per block (drafted and verified per step).
    pub block_size: usize,
    context: Vec<(Tensor, Tensor)>,
}

impl<'a> Draft<'a> {
    pub fn new(drafter: &'a Drafter, heads: Heads<'a>, block_size: usize) -> Self {
        Self {
            drafter,
            heads,
            block_size,
            context: Vec::new(),
        }
    }
}

impl Proposer for Draft<'_> {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn mask_token(&self) -> u32 {
        self.drafter.config.mask_token_id
    }

    fn target_layer_ids(&self) -> &[usize] {
        &self.drafter.config.target_layer_ids
    }

    fn start(&mut self, features: &Tensor) -> Result<(), String> {
        self.context = self.drafter.context_at(features, 0).map_err(err)?;
        Ok(())
    }

    fn extend(&mut self, features: &Tensor, offset: usize) -> Result<(), String> {
        let more = self.drafter.context_at(features, offset).map_err(err)?;
        for ((k, v), (k2, v2)) in self.context.iter_mut().zip(more) {
            *k = Tensor::cat(&[&*k, &k2], 1).map_err(err)?;
            *v = Tensor::cat(&[&*v, &v2], 1).map_err(err)?;
        }
        Ok(())
    }

    fn propose(&mut self, token: u32, position: usize, b: usize) -> Result<Vec<u32>, String> {
        self.drafter
            .draft(&self.context, token, position, b, self.heads)
            .map_err(err)
    }

    /// Each position's token drawn from the drafter's distribution at `sampling`, in order.
    fn propose_sampled(
        &mut self,
        token: u32,
        position: usize,
        b: usize,
        sampling: &Sampling,
        rng: &mut SplitMix64,
    ) -> Result<(Vec<u32>, Vec<Proposal>), String> {
        let Some(logits) = self
            .drafter
            .draft_logits(&self.context, token, position, b, self.heads)
            .map_err(err)?
        else {
            return Ok((Vec::new(), Vec::new()));
        };
        let rows = logits.to_vec2::<f32>().map_err(err)?;
        let mut tokens = Vec::with_capacity(rows.len());
        let mut proposals = Vec::with_capacity(rows.len());
        for row in &rows {
            let q = probabilities(row, sampling)?;
            tokens.push(draw(&q, rng));
            proposals.push(Proposal::Drawn(q));
        }
        Ok((tokens, proposals))
    }
}

/// One prompt decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The new tokens (the prompt not included).
    pub output_ids: Vec<u32>,
    /// Tokens gained per verify step (for plain decoding, 1 per step).
    pub acceptance: Vec<u32>,
    /// Seconds after the prefill.
    pub decode_seconds: f64,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The greedy choice of each row of `[rows, vocab]` f32 logits.
fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>, String> {
    logits
        .argmax(D::Minus1)
        .and_then(|l| l.to_vec1::<u32>())
        .map_err(err)
}

impl Target<'_> {
    /// The hidden-state indices a step asks for: the drafter's features (layer id k is hidden
    /// state k + 1), then the final normed state for the logits.
    fn indices(&self, draft: Option<&dyn Proposer>) -> Vec<usize> {
        let mut indices: Vec<usize> = draft.map_or_else(Vec::new, |d| {
            d.target_layer_ids().iter().map(|l| l + 1).collect()
        });
        indices.push(self.model.config.num_hidden_layers);
        indices
    }

    /// Runs `tokens` after what `cache` holds: the logits (f32, `[rows, vocab]`) after each of
    /// the last `choices` of them (only those rows meet the output head: a prefill needs one, not
    /// a `[prompt, vocab]` matrix), and the drafter's features of each (`[n, width]`) when asked.
    fn step(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        indices: &[usize],
        features: bool,
        choices: usize,
    ) -> Result<(Tensor, Option<Tensor>), String> {
        let mut states = self
            .model
            .extend(std::slice::from_mut(cache), &[tokens], indices)
            .map_err(err)?
            .pop()
            .ok_or("the target returned no states")?;
        let last = states.pop().ok_or("the target returned no final state")?;
        let rows = choices.clamp(1, tokens.len());
        let next = last
            .narrow(0, tokens.len() - rows, rows)
            .and_then(|l| l.matmul(&self.lm_head.t()?))
            .and_then(|l| l.to_dtype(DType::F32))
            .map_err(err)?;
        let features = if features && !states.is_empty() {
            Some(Tensor::cat(&states, D::Minus1).map_err(err)?)
        } else {
            None
        };
        Ok((next, features))
    }

    /// Decodes `prompt` greedily: with `draft`, speculatively; without, one token per target
    /// pass. At most `max_new_tokens` new tokens (the first, from the prefill, included), ending
    /// after the first of `stop` generated.
    pub fn generate(
        &self,
        draft: Option<&mut dyn Proposer>,
        prompt: &[u32],
        max_new_tokens: usize,
        stop: &[u32],
    ) -> Result<Generation, String> {
        self.decode(draft, prompt, max_new_tokens, stop, None)
    }

    /// [`Target::generate`] sampling at `sampling` from `rng`: the drafted tokens verified by
    /// rejection sampling, so the output is distributed as the target's own sampling.
    pub fn sample(
        &self,
        draft: Option<&mut dyn Proposer>,
        prompt: &[u32],
        max_new_tokens: usize,
        stop: &[u32],
        sampling: &Sampling,
        rng: &mut SplitMix64,
    ) -> Result<Generation, String> {
        self.decode(draft, prompt, max_new_tokens, stop, Some((sampling, rng)))
    }

    fn decode(
        &self,
        mut draft: Option<&mut dyn Proposer>,
        prompt: &[u32],
        max_new_tokens: usize,
        stop: &[u32],
        mut sampling: Option<(&Sampling, &mut SplitMix64)>,
    ) -> Result<Generation, String> {
        if let Some((s, _)) = &sampling {
            s.check()?;
        }
        if prompt.is_empty() {
            return Err("an empty prompt".into());
        }
        let n = prompt.len();
        let max_length = n + max_new_tokens;
        let block = draft.as_deref().map_or(1, |d| d.block_size().max(1));
        let mask = draft.as_deref().map_or(0, |d| d.mask_token());
        let indices = self.indices(draft.as_deref());
        let mut cache = KvCache::default();
        let (logits, features) = self.step(&mut cache, prompt, &indices, draft.is_some(), 1)?;
        let mut out: Vec<u32> = prompt.to_vec();
        let first = match sampling.as_mut() {
            None => *argmax_rows(&logits)?.last().ok_or("no logits")?,
            Some((s, rng)) => {
                let rows = logits.to_vec2::<f32>().map_err(err)?;
                draw(&probabilities(rows.last().ok_or("no logits")?, s)?, rng)
            }
        };
        out.push(first);
        if max_new_tokens == 0 {
            out.truncate(n);
        }
        if let (Some(d), Some(f)) = (draft.as_deref_mut(), &features) {
            d.start(f)?;
        }
        let started = Instant::now();
        let mut acceptance = Vec::new();
        let mut start = n;
        let mut stopped = out.len() > n && stop.contains(&out[n]);
        while start + 1 < max_length && !stopped {
            let verify = block.min(max_length - start);
            let mut tokens = vec![out[start]];
            let mut proposals = Vec::new();
            if verify > 1
                && let Some(d) = draft.as_deref_mut()
            {
                let drafted = match sampling.as_mut() {
                    None => d.propose(out[start], start, verify)?,
                    Some((s, rng)) => {
                        let (drafted, drawn) =
                            d.propose_sampled(out[start], start, verify, s, rng)?;
                        proposals = drawn;
                        drafted
                    }
                };
                tokens.extend(drafted.into_iter().take(verify - 1));
            }
            tokens.resize(verify, mask);
            // An undrafted position holds the mask token, proposed with certainty.
            proposals.resize(verify - 1, Proposal::Point);
            let (logits, features) =
                self.step(&mut cache, &tokens, &indices, verify > 1, verify)?;
            let (accepted, next) = match sampling.as_mut() {
                None => {
                    let posterior = argmax_rows(&logits)?;
                    let accepted = tokens[1..]
                        .iter()
                        .zip(&posterior)
                        .take_while(|(a, b)| a == b)
                        .count();
                    (accepted, posterior[accepted])
                }
                Some((s, rng)) => {
                    let rows = logits.to_vec2::<f32>().map_err(err)?;
                    let target = rows
                        .iter()
                        .map(|r| probabilities(r, s))
                        .collect::<Result<Vec<_>, _>>()?;
                    crate::sampling::verify(&tokens[1..], &proposals, &target, rng)?
                }
            };
            let mut gained: Vec<u32> = tokens[1..=accepted].to_vec();
            gained.push(next);
            gained.truncate(max_length - start - 1);
            if let Some(i) = gained.iter().position(|t| stop.contains(t)) {
                gained.truncate(i + 1);
                stopped = true;
            }
            let produced = gained.len();
            out.truncate(start + 1);
            out.extend_from_slice(&gained);
            // The target's cache and the drafter's context keep the verified positions only:
            // the block's first `produced` tokens (the last gained token is the next block's
            // first, not yet run).
            cache.truncate(start + produced).map_err(err)?;
            if let (Some(d), Some(f)) = (draft.as_deref_mut(), features) {
                d.extend(&f.narrow(0, 0, produced).map_err(err)?, start)?;
            }
            start += produced;
            acceptance.push(produced as u32);
        }
        out.truncate((start + 1).min(max_length));
        Ok(Generation {
            output_ids: out.split_off(n),
            acceptance,
            decode_seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// Loads the drafter of a checkpoint directory (`config.json` in the DFlash draft layout and
/// `model.safetensors`, any float dtype), every tensor present and of its shape, none unknown;
/// its forward pass computes in `compute`.
pub fn load_drafter(dir: &Path, device: &Device, compute: DType) -> Result<Drafter, ModelError> {
    load_drafter_with(dir, device, compute, None)
}

/// [`load_drafter`], or with `init_seed` the untrained drafter of the checkpoint's shape, its
/// weights drawn from that seed as a run of that seed starts (the weights file is not read).
pub fn load_drafter_with(
    dir: &Path,
    device: &Device,
    compute: DType,
    init_seed: Option<u64>,
) -> Result<Drafter, ModelError> {
    let invalid = |path: &Path, reason: String| ModelError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let c = DraftConfig::read(dir)?;
    if c.dflash2.is_some() || c.sliding_window.is_some() {
        let path = dir.join("config.json");
        return Err(invalid(
            &path,
            "a DFlash2 or sliding-window drafter is decoded by the torch engine only: pass --engine torch".into(),
        ));
    }
    let config = DrafterConfig {
        shape: c.shape.clone(),
        block_size: c.block_size,
        mask_token_id: c.mask_token_id,
        target_layer_ids: c.target_layer_ids.clone(),
        dflash2: c.dflash2,
        sliding_window: c.sliding_window,
    };
    if let Some(seed) = init_seed {
        return Ok(Drafter::new(config, seed, device)?.with_compute(compute));
    }
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, device)
        .map_err(|e| invalid(&path, format!("cannot read the weights: {e}")))?;
    let drafter = Drafter::new(config, 0, device)?.with_compute(compute);
    for p in &drafter.params {
        let t = tensors
            .remove(&p.name)
            .ok_or_else(|| invalid(&path, format!("has no tensor {}", p.name)))?;
        if t.dims() != p.var.as_tensor().dims() {
            return Err(invalid(
                &path,
                format!(
                    "{} has shape {:?}, config.json makes it {:?}",
                    p.name,
                    t.dims(),
                    p.var.as_tensor().dims()
                ),
            ));
        }
        if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(invalid(
                &path,
                format!(
                    "tensor {} is {:?}: a drafter's weights are F32, BF16 or F16",
                    p.name,
                    t.dtype()
                ),
            ));
        }
        let t = t.to_dtype(DType::F32)?;
        // One reduction: a NaN or an infinity anywhere makes the sum of magnitudes non-finite.
        let total = t.abs()?.sum_all()?.to_scalar::<f32>()?;
        if !total.is_finite() {
            return Err(invalid(
                &path,
                format!(
                    "tensor {} holds non-finite values (NaN or infinity)",
                    p.name
                ),
            ));
        }
        p.var.set(&t)?;
    }
    if let Some(extra) = tensors.keys().min() {
        return Err(invalid(
            &path,
            format!("has a tensor this drafter does not know: {extra}"),
        ));
    }
    Ok(drafter)
}

/// A decoding request (`--eval`, `--generate`) from the orchestrator's file: read, and refused
/// when another `EVAL_VERSION` wrote it.
pub(crate) fn read_request<T: serde::de::DeserializeOwned>(
    path: &Path,
    version: impl Fn(&T) -> u32,
) -> Result<T, String> {
    use dflash_common::eval::EVAL_VERSION;
    let text = if path == Path::new("-") {
        // One JSON line on stdin: no request file anyone else could read or replace.
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::stdin().lock(), &mut line)
            .map_err(|e| format!("cannot read the request on stdin: {e}"))?;
        line.into_bytes()
    } else {
        std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?
    };
    let req: T = serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if version(&req) != EVAL_VERSION {
        return Err(format!(
            "{}: request version {}, this worker speaks {EVAL_VERSION}",
            path.display(),
            version(&req)
        ));
    }
    Ok(req)
}

/// The whole target of `dir` on this worker's device, in `precision`, with its embedding and
/// output head.
pub(crate) fn load_target(
    dir: &Path,
    precision: dflash_common::dflash::Precision,
) -> Result<(Device, Qwen3, Tensor, Tensor), String> {
    let device = crate::dflash::device()?;
    let dtype = crate::dflash::dtype(precision);
    let model = Qwen3::load(dir, None, &device, dtype).map_err(err)?;
    let (embedding, lm_head) = crate::model::qwen3::load_heads(dir, &device, dtype).map_err(err)?;
    Ok((device, model, embedding, lm_head))
}

/// `dflash-worker --eval REQUEST.json`: decodes every prompt of the request on this worker's
/// device and prints one [`PromptResult`](dflash_common::eval::PromptResult) JSON line per prompt
/// on stdout as it finishes.
pub fn run_eval(request: &Path) -> Result<(), String> {
    use dflash_common::eval::{EvalRequest, PromptResult};
    use std::io::Write;
    let req: EvalRequest = read_request(request, |r: &EvalRequest| r.version)?;
    if let Some(runtime) = &req.torch {
        // The untrained drafter: the weights a run of that seed starts from, drawn here.
        let init = match req.init_seed {
            None => None,
            Some(seed) => {
                let c = DraftConfig::read(&req.drafter).map_err(err)?;
                let config = DrafterConfig {
                    shape: c.shape,
                    block_size: c.block_size,
                    mask_token_id: c.mask_token_id,
                    target_layer_ids: c.target_layer_ids,
                    dflash2: c.dflash2,
                    sliding_window: c.sliding_window,
                };
                Some(crate::torch::InitialDrafter::write(
                    &req.drafter,
                    &config,
                    seed,
                )?)
            }
        };
        // The decoder runs in a directory of its own: the paths it reads are made absolute.
        let req = EvalRequest {
            drafter: absolute(init.as_ref().map_or(&req.drafter, |d| &d.0))?,
            target_model: absolute(&req.target_model)?,
            init_seed: None,
            ..req.clone()
        };
        return crate::torch::decode("eval", &req, runtime);
    }
    let target_config = crate::model::qwen3::read_config(&req.target_model).map_err(err)?;
    DraftConfig::read(&req.drafter)
        .map_err(err)?
        .check_target(&target_config)
        .map_err(|e| format!("{}: {e}", req.drafter.display()))?;
    let (device, model, embedding, lm_head) = load_target(&req.target_model, req.dtype)?;
    let dtype = crate::dflash::dtype(req.dtype);
    let drafter = load_drafter_with(&req.drafter, &device, dtype, req.init_seed).map_err(err)?;
    let target = Target {
        model: &model,
        lm_head: &lm_head,
    };
    let mut draft = Draft::new(
        &drafter,
        Heads {
            embedding: &embedding,
            lm_head: &lm_head,
        },
        req.block_size,
    );
    let mut stdout = std::io::stdout().lock();
    if let Some(s) = &req.sampling {
        s.check()?;
    }
    for (i, prompt) in req.prompts.iter().enumerate() {
        let (max_new, stop) = (req.max_new_tokens, &req.stop_token_ids);
        let (spec, baseline) = match &req.sampling {
            None => (
                target.generate(Some(&mut draft), prompt, max_new, stop)?,
                req.baseline
                    .then(|| target.generate(None, prompt, max_new, stop))
                    .transpose()?,
            ),
            Some(s) => {
                // Prompt i's own streams: its output does not depend on the prompts before it.
                let mut rng = SplitMix64(s.stream(i as u64));
                let spec = target.sample(Some(&mut draft), prompt, max_new, stop, s, &mut rng)?;
                let mut rng = SplitMix64(!s.stream(i as u64));
                let baseline = req
                    .baseline
                    .then(|| target.sample(None, prompt, max_new, stop, s, &mut rng))
                    .transpose()?;
                (spec, baseline)
            }
        };
        let result = PromptResult {
            prompt: i,
            output_ids: spec.output_ids,
            acceptance: spec.acceptance,
            speculative_seconds: spec.decode_seconds,
            baseline_seconds: baseline.as_ref().map(|b| b.decode_seconds),
            baseline_ids: baseline.map(|b| b.output_ids),
        };
        let line = serde_json::to_string(&result).map_err(err)?;
        writeln!(stdout, "{line}")
            .and_then(|()| stdout.flush())
            .map_err(|e| format!("cannot write the result: {e}"))?;
    }
    Ok(())
}

/// `path` made absolute against this process's working directory (for a child that runs in
/// another).
pub fn absolute(path: &Path) -> Result<std::path::PathBuf, String> {
    std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))
}
