#!/usr/bin/env python3
"""Recipe benchmark: drafter recipes compared on a small real target that has learnt something, at
equal optimiser steps and on identical data. Run by scripts/bench-recipe (see its --help).

A benchmark, not a test. The stages, each cached in --out and redone only when its settings (or an
earlier stage) change:

  target    A byte-level BPE tokenizer (the `tokenizers` library; chatml's <|im_start|> and
            <|im_end|>, <|endoftext|> as padding and a <|mask|> token as the last id, the
            drafters' mask) and a small Qwen3 causal LM trained with torch on this CPU on a real
            corpus: the Python standard library's own source files (sysconfig's "stdlib",
            site-packages and test suites left out). Files are split by a hash of their path into
            training files and held-out files. Every training sequence is one chatml turn pair:
            the user gives a snippet of a file, the assistant continues it with the lines that
            follow (no turn ends with a newline). The held-out loss (all tokens, and the replies alone) is measured on snippets
            of the held-out files before and after training. Saved as a Hugging Face directory:
            config.json, model.safetensors, generation_config.json, tokenizer.json,
            tokenizer_config.json.
  data      Prompts made the same way (snippets of training files for training, of held-out files
            for evaluation) written as conversations (`dflash-orch generate`'s input); the target
            writes the replies (`dflash-orch generate`, greedy by default, or sampled with
            --gen-temperature); `dflash-orch prepare` makes the store. The evaluation prompts are
            rendered here with the chatml template and the target's tokenizer into input_ids (what
            every decoder below reads), checked against the rendering `generate` used.
  runs      One drafter per recipe (ARCH:LOSS, e.g. dflash2:dpace) with `dflash-orch launch
            --stage dflash --engine torch` on CPU workers: the same store, plan, seed, epochs,
            learning rate, drafter layers and anchors for every recipe; the optimiser steps are
            checked equal.
  served    τ of every drafter on the held-out prompts: our `dflash-orch eval` and the official
            `dflash` package (scripts/official_dflash.py), greedy (T = 0) and sampled (T = 1,
            `--temperature 1 --seed S`);
            the untrained drafter of each architecture (`eval --init-seed`); and prompt-lookup
            decoding with the same target in transformers: each step drafts the tokens that
            followed the latest earlier occurrence of the last n tokens (n = 3, 2, 1) of the
            prompt and the output so far, up to block size - 1 of them, and one target pass
            verifies them: greedily at T = 0 (the longest agreeing prefix and the target's next
            token), by rejection sampling at T > 0 (a draft token x is accepted with probability
            p(x), p the target's distribution at T; on a rejection the token is drawn from p with x
            removed, renormalised; when every draft token is accepted one more is drawn from p).

τ is the one `dflash-orch eval` and the official package report: per prompt the mean number of
tokens one verify step gains (accepted draft tokens + 1, the prefill's token not counted, the last
step cut at the stop token or at --max-new-tokens), then the mean over prompts.

Prints the table (markdown) on stdout and writes it to OUT/results.md, and every raw figure to
OUT/results.json. Progress goes to stderr. Exit status: 0 done, 1 a step failed (named, with the
end of its output), 2 bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

MARKER = ".bench-recipe"
MARKER_TEXT = "made by scripts/bench-recipe; it may replace what it wrote here\n"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
MASK = "<|mask|>"  # the last id
ARCHS = ("dflash", "dflash2")
LOSSES = ("ce", "kd", "mix", "dpace", "kd-dpace")
DEFAULT_RECIPES = "dflash:ce,dflash:dpace,dflash2:ce,dflash2:dpace"
T0_START = time.time()


def log(msg: str) -> None:
    print(f"bench-recipe [{time.time() - T0_START:7.1f}s] {msg}", file=sys.stderr, flush=True)


class Failure(Exception):
    """A step failed; the message names it."""


class Usage(Exception):
    """Bad options, found before anything was written."""


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

PROMPT_CHARS = (150, 450)  # the length of a data or evaluation prompt's snippet, in characters
QUICK = dict(
    target_hidden=128, target_layers=2, target_intermediate=384, vocab=1024, target_steps=120,
    target_batch=8, target_seq=256, samples=200, eval_prompts=4, reply_tokens=32, epochs=2,
    num_anchors=8, token_budget=2048, accum=2,
)
FULL = dict(
    target_hidden=256, target_layers=4, target_intermediate=768, vocab=2048, target_steps=700,
    target_batch=16, target_seq=320, samples=2500, eval_prompts=32, reply_tokens=64, epochs=4,
    num_anchors=16, token_budget=2048, accum=1,
)


def int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be {lo}..{hi}, got {v}")
        return v
    return parse


def float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}")
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(
                f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {text}")
        return v
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench-recipe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    root = Path(__file__).resolve().parent.parent
    p.add_argument("--out", type=Path, default=Path("/tmp/bench-recipe"),
                   help="where everything goes (and the caches live) [default: /tmp/bench-recipe]")
    p.add_argument("--python", type=Path, default=root / ".venv" / "bin" / "python",
                   help="the Python of the torch engine and the official package [default: .venv]")
    p.add_argument("--orch", type=Path, default=root / "target" / "release" / "dflash-orch",
                   help="the dflash-orch binary [default: target/release/dflash-orch]")
    p.add_argument("--quick", action="store_true",
                   help="a tiny configuration (a few minutes) that checks the benchmark works")
    p.add_argument("--fresh", action="store_true", help="ignore every cached stage in --out")
    p.add_argument("--threads", type=int_in(1, 1024), default=None,
                   help="torch threads of the target's training and the prompt-lookup decoding "
                        "[default: the CPUs this process may use]")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0,
                   help="seed of the corpus split, the target, the prompts and every drafter run")
    g = p.add_argument_group("target (defaults: full / --quick)")
    g.add_argument("--target-hidden", type=int_in(32, 4096))
    g.add_argument("--target-layers", type=int_in(1, 64))
    g.add_argument("--target-heads", type=int_in(1, 64), default=4)
    g.add_argument("--target-kv-heads", type=int_in(1, 64), default=2)
    g.add_argument("--target-intermediate", type=int_in(16, 65536))
    g.add_argument("--vocab", type=int_in(512, 65536),
                   help="tokenizer vocabulary (BPE merges, specials and the mask) [2048 / 1024]")
    g.add_argument("--target-steps", type=int_in(0, 1_000_000),
                   help="optimiser steps of the target's training [700 / 120]")
    g.add_argument("--target-batch", type=int_in(1, 4096), help="sequences per step [16 / 8]")
    g.add_argument("--target-seq", type=int_in(64, 4096), help="longest training sequence [320 / 256]")
    g.add_argument("--target-lr", type=float_in(0, 1, lo_open=True), default=3e-3)
    g = p.add_argument_group("data")
    g.add_argument("--samples", type=int_in(50, 1_000_000), help="training prompts [2500 / 200]")
    g.add_argument("--eval-prompts", type=int_in(1, 10000), help="held-out prompts [32 / 8]")
    g.add_argument("--reply-tokens", type=int_in(8, 4096),
                   help="new tokens per reply, in generate and every decoder [64 / 32]")
    g.add_argument("--gen-temperature", type=float_in(0, 100), default=0.0,
                   help="generate's temperature: 0 greedy (the default), above 0 sampled")
    g = p.add_argument_group("drafters (the same for every recipe)")
    g.add_argument("--recipes", default=DEFAULT_RECIPES,
                   help=f"ARCH:LOSS[:stopgrad],... with ARCH in {'|'.join(ARCHS)} and LOSS in "
                        f"{'|'.join(LOSSES)}; :stopgrad (dflash2) adds launch "
                        f"--selector-stop-gradient [default: {DEFAULT_RECIPES}]")
    g.add_argument("--epochs", type=int_in(1, 1000), help="epochs of every run [4 / 2]")
    g.add_argument("--steps", type=int_in(1, 10_000_000),
                   help="at least this many optimiser steps: the epochs are chosen from the plan "
                        "(instead of --epochs)")
    g.add_argument("--lr", type=float_in(0, 1, lo_open=True), default=3e-3)
    g.add_argument("--draft-layers", type=int_in(1, 64), default=1)
    g.add_argument("--target-layer-ids", default=None,
                   help="target layers feeding the drafter [default: 1 and the last layer; 0,1 "
                        "for a 2-layer target]")
    g.add_argument("--block-size", type=int_in(2, 256), default=16)
    g.add_argument("--num-anchors", type=int_in(1, 65536), help="[16 / 8]")
    g.add_argument("--token-budget", type=int_in(256, 1 << 24), help="[2048 / 2048]")
    g.add_argument("--accum", type=int_in(1, 1024), help="[1 / 2]")
    g.add_argument("--gpus", default="cpu:2", help="launch --gpus [default: cpu:2]")
    g.add_argument("--topology", default="1:1", help="launch --topology [default: 1:1]")
    g.add_argument("--launch-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every launch (repeatable; e.g. "
                        "--launch-arg=--selector-stop-gradient)")
    g = p.add_argument_group("served acceptance")
    g.add_argument("--sample-temperature", type=float_in(0, 100, lo_open=True), default=1.0,
                   help="the sampled column's temperature [default: 1]")
    g.add_argument("--sample-seed", type=int_in(0, 2**31 - 1), default=0,
                   help="eval/official --seed of the sampled column, and prompt lookup's")
    g.add_argument("--no-official", action="store_true", help="skip the official package's τ")
    g.add_argument("--no-untrained", action="store_true", help="skip the untrained drafters")
    g.add_argument("--jobs", type=int_in(1, 64), default=1,
                   help="served measurements (eval, official) run at once; each uses every CPU, "
                        "so more than one oversubscribes them (two at once on 2 cores ran about "
                        "ten times slower than one) [default: 1]")
    g.add_argument("--job-timeout", type=int_in(1, 604800), default=1800,
                   help="eval --job-timeout [default: 1800]")
    args = p.parse_args(argv)
    args.epochs_given = args.epochs is not None
    preset = QUICK if args.quick else FULL
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


@dataclasses.dataclass(frozen=True)
class Recipe:
    arch: str
    loss: str
    stop_gradient: bool = False  # DFlash2: launch --selector-stop-gradient

    @staticmethod
    def parse(item: str) -> "Recipe":
        parts = item.strip().split(":")
        if (len(parts) not in (2, 3) or parts[0] not in ARCHS or parts[1] not in LOSSES
                or (len(parts) == 3 and (parts[2] != "stopgrad" or parts[0] != "dflash2"))):
            raise Usage(f"--recipes: {item.strip()!r} is not ARCH:LOSS[:stopgrad] with ARCH in "
                        f"{'|'.join(ARCHS)}, LOSS in {'|'.join(LOSSES)} (stopgrad: dflash2 only)")
        return Recipe(parts[0], parts[1], len(parts) == 3)

    @property
    def name(self) -> str:
        return f"{self.arch}:{self.loss}" + (":stopgrad" if self.stop_gradient else "")

    @property
    def slug(self) -> str:
        return self.name.replace(":", "-")

    @property
    def label(self) -> str:
        return f"{self.arch}, {self.loss}" + (", selector stop-gradient"
                                              if self.stop_gradient else "")

    @property
    def launch_args(self) -> list[str]:
        return ["--loss", self.loss, "--drafter-arch", self.arch] + (
            ["--selector-stop-gradient"] if self.stop_gradient else [])


def check_args(args: argparse.Namespace) -> list[Recipe]:
    """Refuses what cannot run, before anything is written."""
    recipes: list[Recipe] = []
    for item in args.recipes.split(","):
        r = Recipe.parse(item)
        if r in recipes:
            raise Usage(f"--recipes: {r.name} given twice")
        recipes.append(r)
    if args.steps is not None and args.epochs_given:
        raise Usage("--steps and --epochs: give one")
    if args.target_hidden % args.target_heads:
        raise Usage("--target-hidden must be a multiple of --target-heads")
    if (args.target_hidden // args.target_heads) % 2:
        raise Usage("--target-hidden / --target-heads (the head dimension) must be even")
    if args.target_heads % args.target_kv_heads:
        raise Usage("--target-heads must be a multiple of --target-kv-heads")
    if any(r.arch == "dflash2" for r in recipes) and args.target_hidden % 16:
        raise Usage("dflash2 needs --target-hidden divisible by 16 (launch's --conv-group-size)")
    if args.target_layer_ids is None:
        L = args.target_layers
        args.target_layer_ids = "0,1" if L == 2 else "0" if L == 1 else f"1,{L - 1}"
    try:
        ids = [int(x) for x in args.target_layer_ids.split(",")]
    except ValueError:
        raise Usage(f"--target-layer-ids {args.target_layer_ids!r}: not a list of integers")
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < args.target_layers for i in ids):
        raise Usage(f"--target-layer-ids {args.target_layer_ids}: distinct ids in "
                    f"0..{args.target_layers - 1}")
    if args.reply_tokens + args.target_seq + 64 > 4096:
        raise Usage("--reply-tokens + --target-seq must stay under 4,000 (the target's context)")
    for path, what in ((args.python, "--python"), (args.orch, "--orch")):
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise Usage(f"{what} {path}: not an executable file"
                        + (" (run scripts/setup-test-env)" if what == "--python" else
                           " (build it: cargo build --release --bins)"))
    official = Path(__file__).resolve().parent / "official_dflash.py"
    if not args.no_official and not official.is_file():
        raise Usage(f"{official} is missing (or pass --no-official)")
    out = args.out
    if out.exists() and not out.is_dir():
        raise Usage(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise Usage(f"--out {out} is not empty and was not made by bench-recipe (no {MARKER}); "
                    "choose another --out")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not (stdlib / "argparse.py").is_file():
        raise Usage(f"the standard library's sources are not at {stdlib}")
    probe = subprocess.run([str(args.python), "-c", "import torch, transformers, tokenizers"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise Usage(f"--python {args.python} cannot import torch, transformers and tokenizers: "
                    f"{probe.stderr.strip().splitlines()[-1:]}")
    return recipes


# ---------------------------------------------------------------------------------------------
# Running commands, caching stages
# ---------------------------------------------------------------------------------------------

def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "(no output)"
    return "\n".join("    " + line for line in text[-lines:])


CHILDREN: list[subprocess.Popen] = []


def run(label: str, cmd: list[str], logfile: Path, *, echo: bool = False,
        ok_codes: tuple[int, ...] = (0,), env: dict[str, str] | None = None,
        ) -> tuple[int, str]:
    """Runs cmd; stderr goes to logfile (and, with echo, to ours). Returns (code, stdout). A code
    outside ok_codes fails with the command and the end of its stderr."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    log(f"{label}: {' '.join(cmd)}")
    t = time.time()
    with open(logfile, "w") as err, open(logfile.with_suffix(".stdout"), "w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        CHILDREN.append(proc)
        assert proc.stderr is not None
        for line in proc.stderr:
            err.write(line)
            err.flush()
            if echo and line.strip():
                print(f"    {line.rstrip()}", file=sys.stderr, flush=True)
        code = proc.wait()
        CHILDREN.remove(proc)
        out.seek(0)
        stdout = out.read()
    if code not in ok_codes:
        raise Failure(f"{label} failed (exit {code}) after {time.time() - t:.0f} s:\n  "
                      f"{' '.join(cmd)}\n  its stderr ends ({logfile}):\n{tail(logfile)}")
    log(f"{label}: done in {time.time() - t:.1f} s")
    return code, stdout


def key_of(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def cached(stage_dir: Path, key: dict, fresh: bool) -> dict | None:
    """The stamp of stage_dir when it was made with this key (and finished), else None: the
    directory is then removed, to be made again."""
    stamp = stage_dir / "stamp.json"
    if not fresh and stamp.is_file():
        try:
            saved = json.loads(stamp.read_text())
        except ValueError:
            saved = {}
        if saved.get("key") == key:
            return saved
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    return None


def write_stamp(stage_dir: Path, key: dict, result: dict) -> dict:
    saved = {"key": key, **result}
    tmp = stage_dir / "stamp.json.tmp"
    tmp.write_text(json.dumps(saved, indent=1))
    tmp.rename(stage_dir / "stamp.json")
    return saved


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------------------------------------
# The corpus and its snippets
# ---------------------------------------------------------------------------------------------

def corpus_files(seed: int) -> tuple[Path, list[tuple[str, str]], list[tuple[str, str]]]:
    """(stdlib dir, training files, held-out files) as (relative path, text), sorted; about one
    file in 12 is held out, chosen by a hash of its path and the seed."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                 "lib2to3", "idlelib", "turtledemo", "ensurepip", "venv"}
    train: list[tuple[str, str]] = []
    held: list[tuple[str, str]] = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in skip_dirs or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or rel.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if "<|" in text or len(text) < 2000:
            continue
        h = int(hashlib.sha256(f"{seed}:{rel}".encode()).hexdigest()[:8], 16)
        (held if h % 12 == 0 else train).append((str(rel), text))
    return stdlib, train, held


class Snippets:
    """Draws (prefix, continuation) pairs of consecutive lines from a list of files, each file in
    proportion to its length, without their last newlines."""

    def __init__(self, files: list[tuple[str, str]]):
        self.files = [(name, text.splitlines(keepends=True)) for name, text in files]
        self.files = [(n, lines) for n, lines in self.files if len(lines) > 40]
        weights = [sum(len(l) for l in lines) for _, lines in self.files]
        total = float(sum(weights))
        acc, self.cum = 0.0, []
        for w in weights:
            acc += w / total
            self.cum.append(acc)

    def draw(self, rng: random.Random, prefix_chars: tuple[int, int] = (200, 700),
             cont_chars: tuple[int, int] = (300, 1200)) -> tuple[str, str]:
        import bisect
        while True:
            name, lines = self.files[min(bisect.bisect(self.cum, rng.random()), len(self.files) - 1)]
            start = rng.randrange(0, len(lines) - 20)
            want_p, want_c = rng.randint(*prefix_chars), rng.randint(*cont_chars)
            i, prefix = start, ""
            while i < len(lines) and len(prefix) < want_p:
                prefix += lines[i]
                i += 1
            cont = ""
            while i < len(lines) and len(cont) < want_c:
                cont += lines[i]
                i += 1
            if prefix.strip() and len(cont.strip()) > 40:
                # No turn ends right after a newline: a small target then never learns to close
                # its reply before writing a line of it (a reply starts after "assistant\n").
                return prefix.rstrip("\n"), cont.rstrip("\n")


def render_prompt(user: str) -> str:
    """chatml up to the assistant's header: what generate and eval render from a conversation."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def render_pair(user: str, reply: str) -> str:
    return render_prompt(user) + f"{reply}<|im_end|>\n"


# ---------------------------------------------------------------------------------------------
# Stage 1: the target
# ---------------------------------------------------------------------------------------------

def build_tokenizer(train: list[tuple[str, str]], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 1, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((text for _, text in train), trainer)
    tok.add_special_tokens([MASK])
    if tok.get_vocab_size() != vocab:
        # A corpus too small for the merges asked for: the mask is still the last id.
        log(f"the tokenizer has {tok.get_vocab_size()} tokens (asked for {vocab})")
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    assert tok.token_to_id(MASK) == tok.get_vocab_size() - 1
    return tok


def encode_pairs(tok, pairs: list[tuple[str, str]], seq: int) -> list[list[int]]:
    encs = tok.encode_batch([render_pair(u, r) for u, r in pairs], add_special_tokens=False)
    return [e.ids[:seq] for e in encs]


def batch_tensors(rows: list[list[int]]):
    import torch
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, labels, mask


def heldout_loss(model, tok, pairs: list[tuple[str, str]], seq: int) -> dict[str, float]:
    """Mean next-token cross-entropy (nats) over every token, and over the replies' tokens (after
    the assistant header), of held-out pairs."""
    import torch
    import torch.nn.functional as F
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    tot = tot_n = rep = rep_n = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(pairs), 16):
            rows = encode_pairs(tok, pairs[i:i + 16], seq)
            ids, labels, mask = batch_tensors(rows)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            ce = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                 reduction="none")
            valid = labels[:, 1:] != -100
            tot += ce[valid].sum().item()
            tot_n += valid.sum().item()
            for b, r in enumerate(rows):
                start = next((j + len(header) for j in range(len(r) - len(header) + 1)
                              if r[j:j + len(header)] == header), len(r))
                # label position j predicts token j + 1: the reply's tokens are start..len-1
                if start < len(r):
                    rep += ce[b, start - 1:len(r) - 1].sum().item()
                    rep_n += len(r) - start
    model.train()
    return {"loss": tot / tot_n, "ppl": math.exp(tot / tot_n),
            "reply_loss": rep / max(rep_n, 1), "reply_ppl": math.exp(rep / max(rep_n, 1)),
            "tokens": int(tot_n)}


def make_target(args: argparse.Namespace, out: Path) -> dict:
    import torch
    import transformers as tf
    _, train, held = corpus_files(args.seed)
    corpus = {"python": sys.version.split()[0], "files_train": len(train), "files_held": len(held),
              "chars": sum(len(t) for _, t in train),
              "hash": key_of([(n, hashlib.sha256(t.encode()).hexdigest()[:12]) for n, t in train + held])}
    key = {"corpus": corpus, "vocab": args.vocab, "hidden": args.target_hidden,
           "layers": args.target_layers, "heads": args.target_heads,
           "kv_heads": args.target_kv_heads, "intermediate": args.target_intermediate,
           "steps": args.target_steps, "batch": args.target_batch, "seq": args.target_seq,
           "lr": args.target_lr, "seed": args.seed, "version": 2}
    tdir = out / "target"
    saved = cached(tdir, key, args.fresh)
    if saved is not None:
        log(f"target: cached in {tdir} (held-out loss {saved['heldout']['loss']:.3f} nats/token)")
        return saved
    log(f"target: corpus {len(train)} training files ({corpus['chars'] / 1e6:.1f} M characters) "
        f"and {len(held)} held-out files of Python {corpus['python']}'s standard library")
    t = time.time()
    tok = build_tokenizer(train, args.vocab)
    vocab = tok.get_vocab_size()
    log(f"target: byte-level BPE of {vocab} tokens in {time.time() - t:.1f} s")
    torch.manual_seed(args.seed)
    head_dim = args.target_hidden // args.target_heads
    config = tf.Qwen3Config(
        vocab_size=vocab, hidden_size=args.target_hidden,
        intermediate_size=args.target_intermediate, num_hidden_layers=args.target_layers,
        num_attention_heads=args.target_heads, num_key_value_heads=args.target_kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["Qwen3ForCausalLM"])
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation="sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    rng = random.Random(args.seed)
    held_src = Snippets(held)
    held_pairs = [held_src.draw(random.Random(args.seed * 7919 + i)) for i in range(128)]
    source = Snippets(train)
    before = heldout_loss(model, tok, held_pairs, args.target_seq)
    log(f"target: Qwen3 {args.target_layers} layers, hidden {args.target_hidden}, "
        f"{n_params / 1e6:.2f} M parameters; held-out loss at init {before['loss']:.3f}; "
        f"training {args.target_steps} steps of {args.target_batch} sequences")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.target_lr, betas=(0.9, 0.95))
    warm = max(1, args.target_steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return args.target_lr * (step + 1) / warm
        frac = (step - warm) / max(1, args.target_steps - warm)
        return args.target_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    t, tokens, curve = time.time(), 0, []
    for step in range(args.target_steps):
        rows = encode_pairs(tok, [source.draw(rng) for _ in range(args.target_batch)],
                            args.target_seq)
        ids, labels, mask = batch_tensors(rows)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(mask.sum())
        curve.append(loss.item())
        if (step + 1) % max(1, args.target_steps // 10) == 0 or step + 1 == args.target_steps:
            recent = curve[-max(1, args.target_steps // 10):]
            log(f"target: step {step + 1}/{args.target_steps}, training loss "
                f"{sum(recent) / len(recent):.3f}, {tokens / (time.time() - t):,.0f} tokens/s")
    train_s = time.time() - t
    after = heldout_loss(model, tok, held_pairs, args.target_seq)
    log(f"target: held-out loss {before['loss']:.3f} -> {after['loss']:.3f} nats/token "
        f"(perplexity {after['ppl']:.2f}; replies {after['reply_loss']:.3f}) after "
        f"{tokens / 1e6:.2f} M tokens in {train_s:.0f} s")
    tmp = out / "target.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 4096,
        "chat_template": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                          "<|im_start|>assistant\n{% endif %}")}, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, indent=1))
    # transformers must load it back, with the tokenizer, as any user would.
    check = tf.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    tf.AutoTokenizer.from_pretrained(tmp)
    reloaded = heldout_loss(check, tok, held_pairs[:16], args.target_seq)
    del check
    if tdir.exists():
        shutil.rmtree(tdir)
    tmp.rename(tdir)
    return write_stamp(tdir, key, {
        "corpus": corpus, "params": n_params, "vocab": vocab, "train_s": train_s,
        "train_tokens": tokens, "heldout_init": before, "heldout": after,
        "heldout_pairs": len(held_pairs), "reloaded_loss_16": reloaded["loss"],
        "final_train_loss": sum(curve[-20:]) / len(curve[-20:]) if curve else None})


# ---------------------------------------------------------------------------------------------
# Stage 2: the data
# ---------------------------------------------------------------------------------------------

def make_data(args: argparse.Namespace, out: Path, target: dict) -> dict:
    from tokenizers import Tokenizer
    key = {"target": key_of(target["key"]), "samples": args.samples,
           "eval_prompts": args.eval_prompts, "reply_tokens": args.reply_tokens,
           "gen_temperature": args.gen_temperature, "seed": args.seed,
           "max_len": max_len(args), "prefix_chars": list(PROMPT_CHARS), "version": 2}
    ddir = out / "data"
    saved = cached(ddir, key, args.fresh)
    if saved is not None:
        log(f"data: cached in {ddir} ({saved['generated']['rows']} replies)")
        return saved
    ddir.mkdir(parents=True)
    _, train, held = corpus_files(args.seed)
    rng = random.Random(args.seed + 1)
    train_src, held_src = Snippets(train), Snippets(held)
    # Prompts a little shorter than the target's training snippets: prompt + reply fit max_len.
    convs = []
    for _ in range(args.samples):
        user, cont = train_src.draw(rng, prefix_chars=PROMPT_CHARS)
        convs.append({"messages": [{"role": "user", "content": user},
                                   {"role": "assistant", "content": cont}]})
    write_jsonl(ddir / "train-prompts.jsonl", convs)
    erng = random.Random(args.seed + 2)
    tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    eval_convs, eval_rows = [], []
    for _ in range(args.eval_prompts):
        user, cont = held_src.draw(erng, prefix_chars=PROMPT_CHARS)
        eval_convs.append({"messages": [{"role": "user", "content": user},
                                        {"role": "assistant", "content": cont}]})
        eval_rows.append({"input_ids": tok.encode(render_prompt(user),
                                                  add_special_tokens=False).ids})
    write_jsonl(ddir / "eval-conversations.jsonl", eval_convs)
    write_jsonl(ddir / "eval-prompts.jsonl", eval_rows)
    log(f"data: {args.samples} training prompts (snippets of training files) and "
        f"{args.eval_prompts} held-out prompts (snippets of held-out files) in {ddir}")
    gen = [str(args.orch), "generate", "--target-model", str(out / "target"),
           "--input", str(ddir / "train-prompts.jsonl"), "--output", str(ddir / "generated.jsonl"),
           "--max-new-tokens", str(args.reply_tokens), "--gpus", "cpu:2", "--batch-size", "32",
           "--engine", "torch", "--python", str(args.python), "--json"]
    if args.gen_temperature > 0:
        gen += ["--temperature", str(args.gen_temperature), "--seed", str(args.seed)]
    t = time.time()
    run("generate", gen, ddir / "logs" / "generate.log")
    gen_s = time.time() - t
    rows = [json.loads(l) for l in (ddir / "generated.jsonl").read_text().splitlines() if l.strip()]
    # Our rendering of a prompt must be generate's, token for token: the eval prompts are ours.
    for conv, row in zip(convs[:50], rows[:50]):
        first = row["loss_mask"].index(1) if 1 in row["loss_mask"] else len(row["input_ids"])
        mine = tok.encode(render_prompt(conv["messages"][0]["content"]),
                          add_special_tokens=False).ids
        if row["input_ids"][:first] != mine:
            raise Failure(f"generate rendered {row.get('source')} differently from this script's "
                          "chatml rendering; the eval prompts would not match the training data")
    stats = reply_stats(rows, args.reply_tokens)
    log(f"data: {stats['rows']} replies, mean {stats['mean_tokens']:.1f} tokens, "
        f"{stats['stopped']:.0%} ended by <|im_end|>, distinct 4-grams within a reply "
        f"{stats['distinct_4grams']:.2f}")
    _, prep_out = run("prepare", [str(args.orch), "prepare", "--input",
                                  str(ddir / "generated.jsonl"), "--output", str(ddir / "store"),
                                  "--max-len", str(max_len(args)), "--min-loss-tokens", "8",
                                  "--json"], ddir / "logs" / "prepare.log")
    prep = json.loads(prep_out or "{}")
    return write_stamp(ddir, key, {"generated": stats, "generate_s": gen_s, "prepare": prep,
                                   "sampled": args.gen_temperature > 0})


def max_len(args: argparse.Namespace) -> int:
    return 512 + args.reply_tokens


def reply_stats(rows: list[dict], cap: int) -> dict:
    lens, stopped, distinct = [], 0, []
    for row in rows:
        reply = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        lens.append(len(reply))
        stopped += bool(reply) and reply[-1] == 2
        grams = [tuple(reply[i:i + 4]) for i in range(len(reply) - 3)]
        if grams:
            distinct.append(len(set(grams)) / len(grams))
    return {"rows": len(rows), "mean_tokens": sum(lens) / max(1, len(lens)),
            "stopped": stopped / max(1, len(rows)), "cap": cap,
            "distinct_4grams": sum(distinct) / max(1, len(distinct))}


# ---------------------------------------------------------------------------------------------
# Stage 3: the drafters
# ---------------------------------------------------------------------------------------------

def common_launch(args: argparse.Namespace, out: Path) -> list[str]:
    return ["--gpus", args.gpus, "--topology", args.topology, "--stage", "dflash",
            "--engine", "torch", "--python", str(args.python),
            "--target-model", str(out / "target"), "--data", str(out / "data" / "store"),
            "--seed", str(args.seed), "--token-budget", str(args.token_budget),
            "--max-len", str(max_len(args)), "--buckets", "auto:4", "--accum", str(args.accum),
            "--draft-layers", str(args.draft_layers), "--target-layer-ids", args.target_layer_ids,
            "--block-size", str(args.block_size), "--num-anchors", str(args.num_anchors),
            "--lr", str(args.lr), "--save-every", "1000000", "--keep-checkpoints", "1",
            *args.launch_arg]


def choose_epochs(args: argparse.Namespace, out: Path) -> tuple[int, int]:
    """(epochs, optimiser steps per epoch) from the plan of the store."""
    _, stdout = run("plan", [str(args.orch), "plan", "--data", str(out / "data" / "store"),
                             "--token-budget", str(args.token_budget), "--max-len",
                             str(max_len(args)), "--buckets", "auto:4", "--accum",
                             str(args.accum), "--seed", str(args.seed), "--json"],
                    out / "logs" / "plan.log")
    batches = int(json.loads(stdout)["batches"])
    per_epoch = math.ceil(batches / args.accum)
    if args.steps is None:
        return args.epochs, per_epoch
    return max(1, math.ceil(args.steps / per_epoch)), per_epoch


def train_drafter(args: argparse.Namespace, out: Path, recipe: Recipe, data: dict,
                  epochs: int) -> dict:
    extra = [*recipe.launch_args, "--epochs", str(epochs)]
    key = {"data": key_of(data["key"]), "launch": common_launch(args, Path("OUT")) + extra,
           "version": 1}
    rdir = out / "runs" / recipe.slug
    saved = cached(rdir, key, args.fresh)
    if saved is not None and (rdir / "run" / "checkpoints" / "latest").is_file():
        log(f"{recipe.name}: cached run in {rdir} ({saved['steps']} steps)")
        return saved
    if rdir.exists():
        shutil.rmtree(rdir)
    rdir.mkdir(parents=True)
    t = time.time()
    run(f"launch {recipe.name}", [str(args.orch), "launch", "--run-dir", str(rdir / "run"),
                                  *common_launch(args, out), *extra],
        rdir / "launch.log", echo=True)
    wall = time.time() - t
    lines = [json.loads(l) for l in (rdir / "run" / "metrics.jsonl").read_text().splitlines()
             if l.strip()]
    steps: dict[int, dict] = {}
    for l in lines:
        if "loss" in l and "step" in l and "accuracy" in l:
            steps[int(l["step"])] = l  # a replayed step's last line counts
    series = [steps[k] for k in sorted(steps)]
    if not series:
        raise Failure(f"launch {recipe.name} recorded no optimiser step in {rdir}/run/metrics.jsonl")
    tenth = max(1, len(series) // 10)

    def mean(rows: list[dict], field: str) -> float | None:
        vals = [r[field] for r in rows if isinstance(r.get(field), (int, float))]
        return sum(vals) / len(vals) if vals else None

    result = {"steps": len(series), "epochs": epochs, "wall_s": wall,
              "tokens": sum(r.get("tokens", 0) for r in series),
              "first_tenth": {f: mean(series[:tenth], f) for f in
                              ("loss", "accuracy", "acceptance_length")},
              "last_tenth": {f: mean(series[-tenth:], f) for f in
                             ("loss", "accuracy", "acceptance_length", "selector_accuracy")}}
    log(f"{recipe.name}: {result['steps']} steps in {wall:.0f} s; last tenth loss "
        f"{result['last_tenth']['loss']:.3f}, accuracy {result['last_tenth']['accuracy']:.3f}, "
        f"acceptance length {result['last_tenth']['acceptance_length']:.2f}")
    return write_stamp(rdir, key, result)


def checkpoint_of(run_dir: Path) -> Path:
    name = (run_dir / "checkpoints" / "latest").read_text().strip()
    return run_dir / "checkpoints" / name


# ---------------------------------------------------------------------------------------------
# Stage 4: served acceptance
# ---------------------------------------------------------------------------------------------

def served(label: str, cmd: list[str], logf: Path, fields: tuple[str, ...]) -> dict:
    """Runs one served measurement (a command that prints its figures as JSON on stdout; exit 1
    means it ran but was not lossless) and keeps `fields` of them."""
    code, stdout = run(label, cmd, logf, ok_codes=(0, 1, 2))
    try:
        v = json.loads(stdout) if code in (0, 1) else None
    except ValueError:
        v = None
    if not isinstance(v, dict) or "tau" not in v:
        raise Failure(f"{label} failed (exit {code}):\n  {' '.join(cmd)}\n  its stderr ends "
                      f"({logf}):\n{tail(logf)}")
    res = {f: v.get(f) for f in fields}
    log(f"{label}: τ {fmt(res['tau'])}" + ("" if code == 0 else " (NOT lossless)"))
    return res


def sampling_args(args: argparse.Namespace, temperature: float) -> list[str]:
    return ["--temperature", str(temperature), "--seed", str(args.sample_seed)] \
        if temperature > 0 else []


def eval_ours(args: argparse.Namespace, out: Path, drafter: Path, tag: str, temperature: float,
              init_seed: int | None = None) -> dict:
    cmd = [str(args.orch), "eval", "--target-model", str(out / "target"), "--drafter", str(drafter),
           "--prompts", str(out / "data" / "eval-prompts.jsonl"), "--max-new-tokens",
           str(args.reply_tokens), "--engine", "torch", "--python", str(args.python),
           "--job-timeout", str(args.job_timeout), "--json", *sampling_args(args, temperature)]
    if init_seed is not None:
        cmd += ["--init-seed", str(init_seed)]
    return served(f"eval {tag}", cmd, out / "logs" / f"eval-{tag}.log",
                  ("tau", "pooled_tau", "speedup", "lossless", "histogram"))


def eval_official(args: argparse.Namespace, out: Path, drafter: Path, tag: str,
                  temperature: float) -> dict:
    script = Path(__file__).resolve().parent / "official_dflash.py"
    cmd = [str(args.python), str(script), "--target-model", str(out / "target"), "--drafter",
           str(drafter), "--prompts", str(out / "data" / "eval-prompts.jsonl"),
           "--max-new-tokens", str(args.reply_tokens), "--stop-token-ids", "2",
           *sampling_args(args, temperature)]
    return served(f"official {tag}", cmd, out / "logs" / f"official-{tag}.log",
                  ("tau", "pooled_tau", "lossless"))


def prompt_lookup(args: argparse.Namespace, out: Path, temperature: float) -> dict:
    """Prompt-lookup decoding with the target in transformers (see the module's docstring)."""
    import torch
    import transformers as tf
    from transformers import DynamicCache
    tf.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    model = tf.AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    prompts = [json.loads(l)["input_ids"] for l in
               (out / "data" / "eval-prompts.jsonl").read_text().splitlines() if l.strip()]
    stop, k_max, max_new = 2, args.block_size - 1, args.reply_tokens

    def draft(ctx: list[int], room: int) -> list[int]:
        for n in (3, 2, 1):
            if len(ctx) <= n:
                continue
            tail_ = ctx[-n:]
            for i in range(len(ctx) - n - 1, -1, -1):  # the latest earlier occurrence
                if ctx[i:i + n] == tail_:
                    return ctx[i + n:i + n + min(k_max, room)]
        return []

    taus, pooled, outputs, lossless = [], [], [], []
    t = time.time()
    with torch.inference_mode():
        for idx, prompt in enumerate(prompts):
            gen = torch.Generator().manual_seed(
                (args.sample_seed * 0x9E3779B97F4A7C15 + idx) % 2**63)

            def pick(logits: torch.Tensor) -> int:
                if temperature <= 0:
                    return int(torch.argmax(logits))
                p = torch.softmax(logits.float() / temperature, dim=-1)
                return int(torch.multinomial(p, 1, generator=gen))

            cache = DynamicCache(config=model.config)
            ids = torch.tensor([prompt])
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            seq = list(prompt) + [pick(logits)]
            n_in, max_length = len(prompt), len(prompt) + max_new
            start = n_in  # seq[start] is the newest token, not yet in the cache
            steps: list[int] = []
            stopped = seq[start] == stop
            while start + 1 < max_length and not stopped:
                room = min(args.block_size, max_length - start) - 1
                d = draft(seq[:start + 1], room) if room > 0 else []
                block = [seq[start]] + d
                logits = model(input_ids=torch.tensor([block]), past_key_values=cache,
                               use_cache=True).logits[0]
                accepted = 0
                if temperature <= 0:
                    target_tokens = torch.argmax(logits, dim=-1).tolist()
                    while accepted < len(d) and d[accepted] == target_tokens[accepted]:
                        accepted += 1
                    bonus = target_tokens[accepted]
                else:
                    probs = torch.softmax(logits.float() / temperature, dim=-1)
                    bonus = None
                    while accepted < len(d):
                        p = probs[accepted]
                        if float(torch.rand((), generator=gen)) < float(p[d[accepted]]):
                            accepted += 1
                            continue
                        residual = p.clone()
                        residual[d[accepted]] = 0.0
                        total = float(residual.sum())
                        residual = residual / total if total > 0 else p
                        bonus = int(torch.multinomial(residual, 1, generator=gen))
                        break
                    if bonus is None:
                        bonus = int(torch.multinomial(probs[accepted], 1, generator=gen))
                new = d[:accepted] + [bonus]
                produced = min(accepted + 1, max_length - start - 1)
                new = new[:produced]
                if stop in new:
                    produced = new.index(stop) + 1
                    new = new[:produced]
                    stopped = True
                seq = seq[:start + 1] + new
                start += produced
                extra = cache.get_seq_length() - start
                if extra > 0:
                    cache.crop(-extra)
                steps.append(produced)
            out_ids = seq[n_in:max_length]
            outputs.append(out_ids)
            if steps:
                taus.append(sum(steps) / len(steps))
                pooled.extend(steps)
            if temperature <= 0:
                ref = model.generate(torch.tensor([prompt]), max_new_tokens=max_new,
                                     do_sample=False, eos_token_id=stop, pad_token_id=0)
                lossless.append(ref[0, n_in:].tolist() == out_ids)
    res = {"tau": sum(taus) / len(taus) if taus else None,
           "pooled_tau": sum(pooled) / len(pooled) if pooled else None,
           "lossless": all(lossless) if temperature <= 0 else None,
           "lossless_prompts": sum(lossless) if temperature <= 0 else None,
           "prompts": len(prompts), "seconds": time.time() - t,
           "mean_output_tokens": sum(map(len, outputs)) / max(1, len(outputs))}
    if temperature <= 0:
        res["target_distribution"] = target_distribution(model, prompts, outputs,
                                                         args.sample_temperature)
    log(f"prompt lookup T={temperature:g}: τ {fmt(res['tau'])}"
        + (f", lossless {res['lossless_prompts']}/{len(prompts)}" if temperature <= 0 else ""))
    return res


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

def fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else str(v)


def target_distribution(model, prompts: list[list[int]], outputs: list[list[int]],
                        temperature: float, top_k: int = 16) -> dict:
    """How sharp the target is where it writes the held-out replies: the mean, over the output
    positions of its greedy replies, of its top-1 probability and entropy at T = 1, and of the
    mass of its top-k tokens at the sampled column's temperature (what a drafter that proposes
    only top-k candidates, as DFlash2's selector does, can reach)."""
    import torch
    top1 = ent = mass = 0.0
    n = 0
    with torch.inference_mode():
        for prompt, out_ids in zip(prompts, outputs):
            if not out_ids:
                continue
            ids = torch.tensor([prompt + out_ids])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(out_ids)]
            p = torch.softmax(logits.float(), dim=-1)
            pt = torch.softmax(logits.float() / temperature, dim=-1)
            top1 += p.max(dim=-1).values.sum().item()
            ent += -(p * torch.log(p.clamp_min(1e-30))).sum(dim=-1).sum().item()
            mass += pt.topk(top_k, dim=-1).values.sum(dim=-1).sum().item()
            n += len(out_ids)
    return {"positions": n, "mean_top1_prob": top1 / max(n, 1),
            "mean_entropy_nats": ent / max(n, 1),
            f"mean_top{top_k}_mass_at_T{temperature:g}": mass / max(n, 1)}


def run_jobs(jobs: dict, workers: int) -> dict:
    """Runs each (function, args[, kwargs]) of jobs, `workers` at a time; the first failure stops
    the others."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
    results: dict = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(job[0], *job[1], **(job[2] if len(job) > 2 else {})): key
                   for key, job in jobs.items()}
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in done:
            if f.exception() is not None:
                for proc in list(CHILDREN):
                    try:
                        os.killpg(proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                raise f.exception()
        for f, key in futures.items():
            results[key] = f.result()
    return results


def cell(v: Any) -> str:
    if isinstance(v, dict):
        tau = v.get("tau")
        if tau is None:
            return "–"
        flag = "" if v.get("lossless") in (True, None) else " (not lossless)"
        return f"{tau:.2f}{flag}"
    return "–"


def table(rows: list[tuple[str, dict]], t_label: str) -> str:
    head = ("| drafter | steps | τ ours T=0 | τ official T=0 | "
            f"τ ours T={t_label} | τ official T={t_label} | train acc. (last tenth) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        acc = r.get("train", {}).get("last_tenth", {}).get("accuracy")
        lines.append(f"| {name} | {r.get('train', {}).get('steps', '–')} | "
                     f"{cell(r.get('ours_t0'))} | {cell(r.get('official_t0'))} | "
                     f"{cell(r.get('ours_t1'))} | {cell(r.get('official_t1'))} | "
                     f"{'–' if acc is None else f'{acc:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
        recipes = check_args(args)
    except Usage as e:
        print(f"bench-recipe: {e}", file=sys.stderr)
        return 2
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(MARKER_TEXT)
    out = out.resolve()
    args.out = out
    import torch
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    timings: dict[str, float] = {}
    results: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                          for k, v in vars(args).items()},
                               "recipes": [r.name for r in recipes]}
    try:
        t = time.time()
        target = make_target(args, out)
        timings["target"] = time.time() - t
        results["target"] = {k: v for k, v in target.items() if k != "key"}
        t = time.time()
        data = make_data(args, out, target)
        timings["data"] = time.time() - t
        results["data"] = {k: v for k, v in data.items() if k != "key"}
        epochs, per_epoch = choose_epochs(args, out)
        log(f"drafters: {epochs} epochs of {per_epoch} optimiser steps for every recipe")
        t = time.time()
        trained: dict[str, dict] = {}
        for r in recipes:
            trained[r.name] = train_drafter(args, out, r, data, epochs)
        timings["train"] = time.time() - t
        steps = {n: v["steps"] for n, v in trained.items()}
        if len(set(steps.values())) != 1:
            raise Failure(f"the recipes trained unequal optimiser steps: {steps}")
        t = time.time()
        T = args.sample_temperature
        # Every served measurement is its own process; --jobs of them run at once.
        jobs: dict[tuple[str, str], Any] = {}
        names: list[tuple[str, str]] = []
        for r in recipes:
            ckpt = checkpoint_of(out / "runs" / r.slug / "run")
            name = r.label
            names.append((name, r.name))
            jobs[(r.name, "ours_t0")] = (eval_ours, (args, out, ckpt, f"{r.slug}-t0", 0.0))
            jobs[(r.name, "ours_t1")] = (eval_ours, (args, out, ckpt, f"{r.slug}-t{T:g}", T))
            if not args.no_official:
                jobs[(r.name, "official_t0")] = (eval_official,
                                                 (args, out, ckpt, f"{r.slug}-t0", 0.0))
                jobs[(r.name, "official_t1")] = (eval_official,
                                                 (args, out, ckpt, f"{r.slug}-t{T:g}", T))
        if not args.no_untrained:
            for arch in dict.fromkeys(r.arch for r in recipes):
                r = next(x for x in recipes if x.arch == arch)
                ckpt = checkpoint_of(out / "runs" / r.slug / "run")
                key = f"untrained-{arch}"
                names.append((f"{arch}, untrained (`eval --init-seed {args.seed}`)", key))
                jobs[(key, "ours_t0")] = (eval_ours, (args, out, ckpt, f"{key}-t0", 0.0),
                                          {"init_seed": args.seed})
                jobs[(key, "ours_t1")] = (eval_ours, (args, out, ckpt, f"{key}-t{T:g}", T),
                                          {"init_seed": args.seed})
        served = run_jobs(jobs, args.jobs)
        rows: list[tuple[str, dict]] = []
        for name, key in names:
            row: dict[str, Any] = {k[1]: v for k, v in served.items() if k[0] == key}
            if key in trained:
                row["train"] = {k: v for k, v in trained[key].items() if k != "key"}
                row["checkpoint"] = str(checkpoint_of(
                    out / "runs" / Recipe.parse(key).slug / "run"))
            rows.append((name, row))
        log("prompt lookup (n-grams 3..1 of the prompt and output, transformers)")
        pld = {"ours_t0": prompt_lookup(args, out, 0.0), "ours_t1": prompt_lookup(args, out, T)}
        rows.append(("prompt lookup (no drafter; columns \"ours\")", pld))
        timings["served"] = time.time() - t
    except Failure as e:
        print(f"bench-recipe: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        for proc in CHILDREN:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        print("bench-recipe: interrupted", file=sys.stderr)
        return 130
    timings["total"] = time.time() - T0_START
    tgt = results["target"]
    gen = results["data"]["generated"]
    summary = (
        f"Target: Qwen3, {args.target_layers} layers, hidden {args.target_hidden}, "
        f"{tgt['params'] / 1e6:.2f} M parameters, BPE vocab {tgt['vocab']}, trained on "
        f"{tgt['train_tokens'] / 1e6:.2f} M tokens of Python {tgt['corpus']['python']}'s standard "
        f"library ({tgt['train_s']:.0f} s): held-out loss {tgt['heldout_init']['loss']:.3f} -> "
        f"**{tgt['heldout']['loss']:.3f}** nats/token (perplexity {tgt['heldout']['ppl']:.2f}; "
        f"replies alone {tgt['heldout']['reply_loss']:.3f}).\n"
        f"Data: {args.samples} prompts, replies written by the target "
        f"({'sampled at T=%g' % args.gen_temperature if args.gen_temperature > 0 else 'greedy'}, "
        f"at most {args.reply_tokens} tokens, mean {gen['mean_tokens']:.1f}, distinct 4-grams "
        f"{gen['distinct_4grams']:.2f}); {args.eval_prompts} held-out prompts, "
        f"{args.reply_tokens} new tokens, block {args.block_size}.\n"
        f"Drafters: {args.draft_layers} layer(s) on target layers {args.target_layer_ids}, "
        f"{rows[0][1]['train']['steps']} optimiser steps ({epochs} epochs), lr {args.lr}, "
        f"{args.num_anchors} anchors, seed {args.seed}; T={T:g} columns: seed {args.sample_seed}.")
    dist = pld["ours_t0"].get("target_distribution") or {}
    if dist.get("positions"):
        summary += (f"\nThe target where it writes the held-out replies (greedy): mean top-1 "
                    f"probability {dist['mean_top1_prob']:.3f}, entropy "
                    f"{dist['mean_entropy_nats']:.2f} nats, top-16 mass at T={T:g} "
                    f"{dist[f'mean_top16_mass_at_T{T:g}']:.3f}.")
    md = summary + "\n\n" + table(rows, f"{T:g}") + "\n"
    results["rows"] = [{"name": n, **r} for n, r in rows]
    results["timings_s"] = timings
    results["table_md"] = md
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(md)
    print(md)
    log(f"done in {timings['total']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in timings.items())}); "
        f"{out}/results.md and results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
