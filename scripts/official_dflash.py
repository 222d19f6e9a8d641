#!/usr/bin/env python3
"""Cross-checks a dflash-orch drafter checkpoint with the official DFlash reference code, the PyPI
package `dflash==0.1.0` (`dflash.model.DFlashDraftModel`, `DFlash2DraftModel` and
`dflash.model.dflash_generate`).

    official_dflash.py --target-model DIR --drafter CKPT_DIR --prompts FILE.jsonl
                       --max-new-tokens N [--stop-token-ids 1,2] [--block-size B]

The target (a Hugging Face Qwen3 directory) is loaded with `transformers` and the drafter with
`DFlashDraftModel.from_pretrained` (`DFlash2DraftModel` where `architectures` names it; its
loader maps the stored codebooks `candidate_selector.*_codebook` onto its embeddings' `.weight`),
both in float32 on the CPU. The drafter must load strictly: no
missing, unexpected or mismatched tensor, and every parameter equal to the tensor of that name in
model.safetensors (so none was left at its random init). The config fields that the official code
needs, or would default silently (see REQUIRED), must be present: a default would hide a mismatch.

Every row of the JSONL prompts file is {"input_ids": [...]}. Each prompt is decoded greedily twice
with `dflash_generate`: speculatively (the drafter's block size, or --block-size) and plainly
(block size 1, the official baseline). With --temperature T (and --top-p, --top-k) it is decoded
once, by the package's speculative sampling (`_rejection_sample`), after seeding torch's
generator with prompt i's stream of --seed, the stream `dflash-orch eval --seed` gives prompt i;
then baseline_ids and lossless are null. Prints one JSON object on stdout:
    {"tau": mean over prompts of mean(acceptance_lengths), "pooled_tau": mean over all steps,
     "prompts": [{"output_ids", "acceptance_lengths", "baseline_ids", "lossless"}], "lossless"}
where the ids are the new tokens only and lossless means output_ids == baseline_ids. Everything
else goes to stderr. Exit status: 0 when every prompt is lossless, 1 when one is not, 2 when the
checkpoint or the environment is not usable.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

import dflash.model
from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate

# Fields of the drafter's config.json that dflash.model (or transformers' Qwen3Config) would
# default silently or trip over later; each may sit at the top level or in "dflash_config"
# ("rope_theta" also in "rope_parameters"). Without num_target_layers the loader raises even when
# target_layer_ids is given; without mask_token_id it loads and dflash_generate fails.
REQUIRED = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "rope_theta")
# DFlash2's sizes, which DFlash2DraftModel reads from dflash_config (vLLM and SGLang too).
DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DFlash2DraftModel's embeddings hold the codebooks that checkpoints store without `.weight`.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def fail(msg):
    log(f"official_dflash: {msg}")
    sys.exit(2)


def check_config(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    sections = (config, config.get("dflash_config", {}), config.get("rope_parameters", {}))
    missing = [k for k in REQUIRED if not any(k in section for section in sections)]
    if missing:
        fail(f"{ckpt}/config.json lacks {', '.join(missing)}, which dflash.model needs (see REQUIRED)")
    classes = {"DFlashDraftModel": DFlashDraftModel, "DFlash2DraftModel": DFlash2DraftModel}
    arch = config.get("architectures")
    if not (isinstance(arch, list) and len(arch) == 1 and arch[0] in classes):
        fail(f"{ckpt}/config.json: architectures is {arch!r}, not ['DFlashDraftModel'] or "
             "['DFlash2DraftModel']")
    if arch[0] == "DFlash2DraftModel":
        fields = config.get("dflash_config", {})
        missing = [k for k in DFLASH2_REQUIRED if k not in fields]
        if missing:
            fail(f"{ckpt}/config.json: dflash_config lacks {', '.join(missing)}, which "
                 "DFlash2DraftModel reads")
    return classes[arch[0]]


def load_strict(cls, path, what):
    try:
        model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # transformers raises on shape mismatches, AttributeError on config gaps
        fail(f"{what} {path} cannot be loaded: {type(e).__name__}: {e}")
    problems = [f"{kind} {key}" for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                for key in info.get(kind) or []]
    if problems:
        fail(f"{what} {path} did not load strictly: " + "; ".join(problems))
    return model.eval()


def load_drafter(ckpt):
    cls = check_config(ckpt)
    draft = load_strict(cls, ckpt, "drafter")
    saved = load_file(ckpt / "model.safetensors")
    if cls is DFlash2DraftModel:
        saved = {(k + ".weight" if k in CODEBOOKS else k): v for k, v in saved.items()}
    params = draft.state_dict()
    if set(saved) != set(params):
        fail(f"drafter tensors differ from {ckpt}/model.safetensors: {sorted(set(saved) ^ set(params))}")
    stale = [k for k, v in params.items() if not torch.equal(v, saved[k].to(v.dtype))]
    if stale:
        fail(f"drafter parameters not taken from the checkpoint (random init?): {stale}")
    return draft


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-model", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--stop-token-ids", type=lambda s: [int(x) for x in s.split(",") if x.strip()])
    p.add_argument("--block-size", type=int)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (dflash_generate's own rejection sampling)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0,
                   help="prompt i (0-based) is decoded after torch.manual_seed(stream(seed, i)), "
                        "the stream our eval seeds prompt i's generator with")
    args = p.parse_args()
    sampled = args.temperature > 0

    if not hasattr(DynamicCache, "activate_past_recording"):
        fail(f"transformers {transformers.__version__} has no DynamicCache.activate_past_recording, which "
             "dflash 0.1.0 calls (added in 5.14; the package pins 5.15.0)")
    # With return_stats=True dflash_generate times itself through _cuda_time, which calls
    # torch.cuda.synchronize(); everything here runs on the CPU, where that call fails.
    dflash.model._cuda_time = time.perf_counter

    target = load_strict(AutoModelForCausalLM, args.target_model, "target")
    draft = load_drafter(args.drafter)
    block_size = args.block_size or draft.block_size
    log(f"target {args.target_model}, drafter {args.drafter} (block size {block_size}, "
        f"target layers {draft.target_layer_ids}, mask token {draft.mask_token_id})")

    rows = []
    for line_no, line in enumerate(args.prompts.read_text().splitlines(), 1):
        if not line.strip():
            continue
        input_ids = torch.tensor([json.loads(line)["input_ids"]], dtype=torch.long)
        stream = (args.seed * 0x9E3779B97F4A7C15 + len(rows)) % 2**63

        def generate(bs):
            torch.manual_seed(stream)
            out = dflash_generate(draft, target, input_ids, args.max_new_tokens, args.stop_token_ids,
                                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  block_size=bs, return_stats=True)
            return out.output_ids[0, out.num_input_tokens:].tolist(), out.acceptance_lengths

        output_ids, acceptance = generate(block_size)
        # Sampled outputs differ from the target's own draws by design: no token comparison.
        baseline_ids = None if sampled else generate(1)[0]
        rows.append({"output_ids": output_ids, "acceptance_lengths": acceptance,
                     "baseline_ids": baseline_ids,
                     "lossless": None if sampled else output_ids == baseline_ids})
        log(f"prompt {line_no}: {len(output_ids)} tokens in {len(acceptance)} steps, "
            f"lossless {rows[-1]['lossless']}")

    per_prompt = [sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"])
                  for r in rows if r["acceptance_lengths"]]
    pooled = [a for r in rows for a in r["acceptance_lengths"]]
    lossless = None if sampled else all(r["lossless"] for r in rows)
    print(json.dumps({
        "tau": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "pooled_tau": sum(pooled) / len(pooled) if pooled else None,
        "prompts": rows,
        "lossless": lossless,
    }))
    sys.exit(0 if lossless or sampled else 1)


if __name__ == "__main__":
    main()
