"""`scripts/bench-step-account` (`python -m dflash_orch.account_cli [--json] [--seq-lens
8192,2048] [--paths legacy,batched]`): what one drafter micro-batch and one target micro-batch
of the torch engine execute, counted op by op at Qwen3-8B widths, and projected onto an H200 by
a stated roofline (the counting is `account`).

The command line's side, without PyTorch: every option is checked before `account` imports torch
(seconds), so a bad one is refused at once, with exit status 2 naming it.
"""

import argparse

# The seeds' shape: anchors per sequence and the micro-batch's token budget (`account` counts
# at them; a sequence length is checked against them here).
ANCHORS = 512
BUDGET = 49152

# The chunks the paths are counted at by default: the legacy path at the chunk `launch
# --anchor-chunk auto` picked for the torch drafter at these settings on an H200 before it sized
# chunks from the GPU's memory (one chunk's activations aimed at 12 GiB, a dense mask counted),
# the batched path at the one it picks now (`launch --dry-run --gpu-memory 141 --max-len 8192`).
DEFAULT_CHUNKS = "legacy=188,batched=3222"
# The drafter step paths counted: the per-sequence one before, the batched one now.
PATHS = ("legacy", "batched")


def parse_chunks(text, paths):
    """`N` (every path) or `PATH=N,...` (every path in `paths` named once) -> {path: N}."""
    if "=" not in text:
        n = _positive(text)
        return {p: n for p in paths}
    chunks = {}
    for part in text.split(","):
        path, _, n = part.partition("=")
        if path not in PATHS:
            raise ValueError(f"{path!r} is not a step path (legacy, batched)")
        if path in chunks:
            raise ValueError(f"{path} is given twice")
        chunks[path] = _positive(n)
    missing = [p for p in paths if p not in chunks]
    if missing:
        raise ValueError(f"no chunk for {', '.join(missing)}")
    return chunks


def _positive(text):
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a count") from None
    if n < 1:
        raise ValueError(f"{n} is not a positive count")
    return n


def main(argv):
    parser = argparse.ArgumentParser(
        prog="bench-step-account", description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="See python/dflash_orch/account.py for the counting and the roofline.")
    parser.add_argument("--seq-lens", default="8192,2048",
                        help="sequence lengths of the micro-batches, comma-separated (default "
                             "8192,2048; each divides the budget 49,152 into equal sequences)")
    parser.add_argument("--paths", default="legacy,batched",
                        help="drafter step paths to count, comma-separated (legacy, batched)")
    parser.add_argument("--anchor-chunk", default=DEFAULT_CHUNKS,
                        help="anchors computed at once: N for every path, or PATH=N,... "
                             f"(default {DEFAULT_CHUNKS}: what `launch --anchor-chunk auto` "
                             "picked for the torch drafter at these settings on an H200 before "
                             "it sized chunks from the GPU's memory, and what it picks now: an "
                             "8,192-token micro-batch's 6 x 512 anchors in one pass, a "
                             "2,048-token one's in 4 chunks of 6 sequences)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    try:
        lens = [int(x) for x in args.seq_lens.split(",")]
    except ValueError:
        parser.error(f"--seq-lens {args.seq_lens!r}: expected integers separated by commas")
    for n in lens:
        if not ANCHORS + 16 <= n <= BUDGET:
            parser.error(f"--seq-lens: {n} is outside {ANCHORS + 16}..{BUDGET} (512 anchors "
                         "need room, a sequence fits the budget)")
    paths = args.paths.split(",")
    for p in paths:
        if p not in PATHS:
            parser.error(f"--paths: {p!r} is not a step path (legacy, batched)")
    try:
        chunks = parse_chunks(args.anchor_chunk, paths)
    except ValueError as e:
        parser.error(f"--anchor-chunk {args.anchor_chunk!r}: {e}")
    from . import account  # torch loads here, once the options are known to be good

    return account.run(lens, paths, chunks, args.json)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
