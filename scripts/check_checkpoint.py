#!/usr/bin/env python3
"""Checks a dflash-orch drafter checkpoint with the Python `safetensors` package, as a serving stack
would load it: tensor names and shapes against config.json, the DFlash fields of config.json, the
`format: pt` metadata, and the optimiser moments beside the weights.

Usage: check_checkpoint.py CHECKPOINT_DIR   (prints a JSON summary; exit 1 on any mismatch)
"""

import json
import sys
from pathlib import Path

from safetensors import safe_open


def expected_shapes(c):
    h, d = c["hidden_size"], c["head_dim"]
    q, kv, inter = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    n = len(c["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": [h, n * h], "hidden_norm.weight": [h], "norm.weight": [h]}
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": [h],
            f"{p}.post_attention_layernorm.weight": [h],
            f"{p}.self_attn.q_proj.weight": [q, h],
            f"{p}.self_attn.k_proj.weight": [kv, h],
            f"{p}.self_attn.v_proj.weight": [kv, h],
            f"{p}.self_attn.o_proj.weight": [h, q],
            f"{p}.self_attn.q_norm.weight": [d],
            f"{p}.self_attn.k_norm.weight": [d],
            f"{p}.mlp.gate_proj.weight": [inter, h],
            f"{p}.mlp.up_proj.weight": [inter, h],
            f"{p}.mlp.down_proj.weight": [h, inter],
        })
    return shapes


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    ckpt = Path(sys.argv[1])
    problems = []
    config = json.loads((ckpt / "config.json").read_text())
    if config.get("architectures") != ["DFlashDraftModel"]:
        problems.append(f"architectures is {config.get('architectures')!r}")
    for key in ("block_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                "rms_norm_eps", "rope_theta"):
        if key not in config:
            problems.append(f"config.json has no {key}")
    dflash = config.get("dflash_config", {})
    if not isinstance(dflash.get("mask_token_id"), int) or not (0 <= dflash["mask_token_id"] < config["vocab_size"]):
        problems.append(f"dflash_config.mask_token_id is {dflash.get('mask_token_id')!r}")
    ids = dflash.get("target_layer_ids")
    if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        problems.append(f"dflash_config.target_layer_ids is {ids!r}")
    want = expected_shapes(config)
    with safe_open(ckpt / "model.safetensors", framework="numpy") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "pt":
            problems.append(f"metadata is {meta!r}, expected format pt")
        names = set(f.keys())
        for name in sorted(names ^ set(want)):
            problems.append(f"{'unexpected' if name in names else 'missing'} tensor {name}")
        for name in sorted(names & set(want)):
            t = f.get_tensor(name)
            if list(t.shape) != want[name]:
                problems.append(f"{name} has shape {list(t.shape)}, expected {want[name]}")
            if str(t.dtype) != "float32":
                problems.append(f"{name} has dtype {t.dtype}")
    with safe_open(ckpt / "optimizer.safetensors", framework="numpy") as f:
        moments = set(f.keys())
        for name in sorted(want):
            for moment in ("m", "v"):
                key = f"{moment}.{name}"
                if key not in moments:
                    problems.append(f"no optimiser moment {key}")
                elif list(f.get_tensor(key).shape) != want[name]:
                    problems.append(f"optimiser moment {key} does not match its weight's shape")
    state = json.loads((ckpt / "state.json").read_text())
    summary = {"checkpoint": str(ckpt), "tensors": len(names), "moments": len(moments),
               "state": state, "problems": problems}
    print(json.dumps(summary))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
