"""A tiny random causal LM of a given architecture, made by `transformers` from a config (no
download), with the tokenizer of another model directory (`dflash-orch init-tiny`'s), for
end-to-end runs of the torch engine on architectures other than Qwen3.

    python tests/make_target.py --arch llama --like TINY_DIR --output DIR [--seed 0]

Architectures: qwen3, llama (llama3 rope scaling), qwen3_moe, gemma3_text, gpt_oss, qwen3_5_text
(gated delta-net layers between attention ones), gpt_neox (its final norm not named `norm`),
deepseek_v3 (latent attention, values narrower than queries; routed experts). The widths
are init-tiny's (hidden 64, 4 layers, 4 heads / 2 key-value heads of 16, MLP 128); the vocabulary,
the special tokens and the tokenizer files are those of --like.
"""

import argparse
import json
import os
import shutil

import torch


def config_for(arch, common, window, original_max):
    """The `transformers` config of a tiny `arch` with the widths of `common`, a sliding window of
    `window` (Gemma 3, gpt-oss) and llama3 scaling from `original_max` positions (Llama). The
    feature check (check_target.py) makes its models here too."""
    import transformers as tf

    if arch == "qwen3":
        return tf.Qwen3Config(**common)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original_max})
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1)
    if arch == "gemma3_text":
        return tf.Gemma3TextConfig(**common, sliding_window=window,
                                   query_pre_attn_scalar=common["head_dim"])
    if arch == "gpt_oss":
        # Every token through all four experts, mixed by the router's weights: a tiny random
        # gpt-oss whose router picks 2 of 4 switches experts on nearly every token, and its
        # replies are too erratic for a drafter to learn in a test's few minutes (served τ
        # 1.0 -> 1.05 with 1 of 4, 1.48 with 1 of 2, 1.61 and 1.95 with 4 of 4, seeds 0 and 1).
        return tf.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=4,
                               sliding_window=window)
    if arch == "qwen3_5_text":
        # Every other layer gated delta-net (Qwen3.5 has three of four).
        layers = ["linear_attention", "full_attention"] * common["num_hidden_layers"]
        return tf.Qwen3_5TextConfig(**common, layer_types=layers[:common["num_hidden_layers"]],
                                    linear_num_key_heads=2, linear_num_value_heads=4,
                                    linear_key_head_dim=common["head_dim"],
                                    linear_value_head_dim=common["head_dim"])
    if arch == "deepseek_v3":
        # Multi-head latent attention: queries and keys of 16 (8 without rotary, 8 with), values
        # of 8; a dense first layer, then 4 routed experts (2 a token) and a shared one.
        fields = {k: v for k, v in common.items() if k not in ("head_dim",)}
        fields["num_key_value_heads"] = fields["num_attention_heads"]
        return tf.DeepseekV3Config(**fields, kv_lora_rank=16, q_lora_rank=None,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                   n_routed_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                   topk_group=1)
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(**{k: v for k, v in common.items()
                                   if k not in ("num_key_value_heads", "head_dim")})
    raise SystemExit(f"unknown architecture {arch!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True)
    ap.add_argument("--like", required=True, help="the model directory whose tokenizer to use")
    ap.add_argument("--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.05,
                    help="standard deviation of the random matrices (larger: replies that depend "
                         "more on the context)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    with open(os.path.join(args.like, "config.json")) as f:
        like = json.load(f)
    special = {k: like[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in like}
    torch.manual_seed(args.seed)
    common = dict(vocab_size=like["vocab_size"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=2048, tie_word_embeddings=False, **special)
    config = config_for(args.arch, common, window=32, original_max=256)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger than the default init: a random model whose greedy replies depend on the context.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, args.std)
    model.save_pretrained(args.output)
    for name in os.listdir(args.like):
        if name.startswith("tokenizer") or name in ("generation_config.json",
                                                    "special_tokens_map.json"):
            shutil.copy(os.path.join(args.like, name), os.path.join(args.output, name))
    print(json.dumps({"arch": args.arch, "output": args.output,
                      "architectures": config.architectures}))


if __name__ == "__main__":
    main()
