#!/usr/bin/env python3
"""A plain Python/numpy converter from pre-tokenized JSON lines to a dataset store, for comparison
with `dflash-orch prepare`.

It does the job the way it is usually done in a training repository today: read the file line by
line, `json.loads` each record, check it, and append the token ids and loss mask to binary files
with numpy. It follows the same rules as dflash-orch (orchestrator/src/commands/prepare.rs and
orchestrator/src/ingest/) and writes the same `tokens.bin`, `loss_mask.bin` and `index.bin`, byte
for byte, plus a `meta.json` with the counts and the size and CRC-32C of every file:

- blank lines are ignored; every other line must be a JSON object;
- `input_ids`: a non-empty list of integers in [0, 2^32) (no floats, booleans or strings);
- `loss_mask` (optional, absent or null means all ones): a list of 0/1 or true/false, as long as
  `input_ids`; other keys are ignored;
- samples longer than --max-len are truncated (or dropped with --on-overlong drop);
- samples with fewer than --min-loss-tokens loss tokens are left out and counted;
- a bad record stops the conversion (--on-bad fail, the default) or is skipped and counted
  (--on-bad skip).

    python scripts/prepare_reference.py --input data.jsonl --output store/ --json

CRC-32C comes from the `crc32c` package; without it, zlib.crc32 (a different checksum, about as
costly) is used and `checksum` in the summary says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

try:
    from crc32c import crc32c as _crc32c

    CHECKSUM = "crc32c"

    def crc(data, value=0):
        return _crc32c(data, value)

except ImportError:  # pragma: no cover - depends on the environment
    import zlib

    CHECKSUM = "zlib.crc32 (crc32c package not installed)"

    def crc(data, value=0):
        return zlib.crc32(data, value)


FORMAT = "dflash-store"
VERSION = 1
FILTERS = ("too_few_loss_tokens", "overlong")  # dropped whatever --on-bad says
EXAMPLES_PER_REASON = 3
BUFFER = 1 << 20

# index.bin: one entry per sample, little-endian.
INDEX_DTYPE = np.dtype([("offset", "<u8"), ("len", "<u4"), ("loss_tokens", "<u4")])


class BadSample(Exception):
    def __init__(self, reason, message):
        super().__init__(message)
        self.reason = reason
        self.message = message


def is_token_id(v):
    return type(v) is int and 0 <= v < 2**32


def is_mask_value(v):
    return type(v) is bool or (type(v) is int and v in (0, 1))


def parse_record(line):
    """Returns (input_ids, loss_mask or None) of one JSON line, or raises BadSample."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise BadSample("malformed_json", f"malformed JSON: {e}") from None
    if not isinstance(record, dict):
        raise BadSample("bad_record", f"expected an object, found {type(record).__name__}")
    ids = record.get("input_ids")
    mask = record.get("loss_mask")
    if ids is None:
        raise BadSample("missing_field", "no input_ids")
    if not isinstance(ids, list):
        raise BadSample("bad_record", "input_ids is not a list")
    if mask is not None and not isinstance(mask, list):
        raise BadSample("bad_record", "loss_mask is not a list")
    for i, v in enumerate(ids):
        if not is_token_id(v):
            raise BadSample("bad_token_id", f"input_ids[{i}]: {v!r} is not a token id")
    if mask is not None:
        for i, v in enumerate(mask):
            if not is_mask_value(v):
                raise BadSample("bad_loss_mask", f"loss_mask[{i}]: {v!r} is not 0 or 1")
    return ids, mask


def check_sample(ids, mask, args):
    """Applies the common checks; returns (ids, mask as 0/1 ints, truncated) or raises BadSample."""
    if not ids:
        raise BadSample("empty_sample", "input_ids is empty")
    if mask is None:
        mask = [1] * len(ids)
    elif len(mask) != len(ids):
        raise BadSample(
            "mask_length_mismatch",
            f"loss_mask has {len(mask)} values, input_ids has {len(ids)}",
        )
    truncated = False
    if len(ids) > args.max_len:
        if args.on_overlong == "drop":
            raise BadSample("overlong", f"{len(ids)} tokens, more than --max-len {args.max_len}")
        ids = ids[: args.max_len]
        mask = mask[: args.max_len]
        truncated = True
    return ids, mask, truncated


class ChecksummedFile:
    """A binary file being written, with its running checksum and size."""

    def __init__(self, path):
        self.file = open(path, "wb", buffering=BUFFER)
        self.crc = 0
        self.bytes = 0

    def write(self, data):
        self.crc = crc(data, self.crc)
        self.bytes += len(data)
        self.file.write(data)

    def close(self):
        self.file.close()
        return {"bytes": self.bytes, "crc32c": self.crc}


def prepare(args):
    started = time.perf_counter()
    out = args.output
    if os.path.exists(out):
        if not args.force:
            sys.exit(f"prepare_reference: {out} already exists (pass --force to replace it)")
        shutil.rmtree(out)
    os.makedirs(out)

    tokens_file = ChecksummedFile(os.path.join(out, "tokens.bin"))
    mask_file = ChecksummedFile(os.path.join(out, "loss_mask.bin"))
    index = []  # (offset, len, loss_tokens) per sample
    tokens = loss_tokens = truncated = 0
    skipped = {}
    examples = []

    def skip(where, bad):
        if bad.reason not in FILTERS and args.on_bad == "fail":
            raise SystemExit(
                f"prepare_reference: {where}: {bad.message} ({bad.reason}); no store was written"
            )
        skipped[bad.reason] = skipped.get(bad.reason, 0) + 1
        if skipped[bad.reason] <= EXAMPLES_PER_REASON:
            examples.append({"reason": bad.reason, "location": where, "message": bad.message})

    input_crc = input_bytes = 0
    try:
        f = open(args.input, "rb", buffering=BUFFER)
    except OSError as e:
        shutil.rmtree(out)
        sys.exit(f"prepare_reference: {args.input}: {e}")
    try:
        for number, line in enumerate(f, 1):
            input_crc = crc(line, input_crc)
            input_bytes += len(line)
            if not line.strip():
                continue
            where = f"{args.input}:{number}"
            try:
                ids, mask = parse_record(line)
                ids, mask, cut = check_sample(ids, mask, args)
            except BadSample as bad:
                skip(where, bad)
                continue
            mask = np.asarray(mask, dtype=np.uint8)
            loss = int(np.count_nonzero(mask))
            if loss < args.min_loss_tokens:
                skip(where, BadSample(
                    "too_few_loss_tokens",
                    f"{loss} loss tokens, fewer than --min-loss-tokens {args.min_loss_tokens}",
                ))
                continue
            tokens_file.write(np.asarray(ids, dtype="<u4").tobytes())
            mask_file.write(mask.tobytes())
            index.append((tokens, len(ids), loss))
            tokens += len(ids)
            loss_tokens += loss
            truncated += cut
    except BaseException:
        # A bad record (or an interrupt): leave nothing behind.
        tokens_file.close()
        mask_file.close()
        shutil.rmtree(out)
        raise
    finally:
        f.close()

    files = {"tokens.bin": tokens_file.close(), "loss_mask.bin": mask_file.close()}
    if not index:
        shutil.rmtree(out)
        sys.exit(f"prepare_reference: no samples to store ({skipped}); no store was written")
    index_bytes = np.array(index, dtype=INDEX_DTYPE).tobytes()
    with open(os.path.join(out, "index.bin"), "wb") as f:
        f.write(index_bytes)
    files["index.bin"] = {"bytes": len(index_bytes), "crc32c": crc(index_bytes)}

    seconds = time.perf_counter() - started
    source = {
        "path": args.input,
        "format": "jsonl",
        "bytes": input_bytes,
        "crc32c": input_crc,
        "samples": len(index),
        "skipped": sum(skipped.values()),
    }
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "samples": len(index),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "vocab_size": None,
        "max_len": args.max_len,
        "on_overlong": args.on_overlong,
        "min_loss_tokens": args.min_loss_tokens,
        "truncated": truncated,
        "skipped": dict(sorted(skipped.items())),
        "skipped_examples": examples,
        "sources": [source],
        "files": dict(sorted(files.items())),
        "created_by": "prepare_reference.py",
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)

    return {
        "store": out,
        "samples": len(index),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "truncated": truncated,
        "skipped": meta["skipped"],
        "sources": [source],
        "input_bytes": input_bytes,
        "seconds": seconds,
        "input_mb_per_s": input_bytes / 1e6 / max(seconds, 1e-9),
        "checksum": CHECKSUM,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="a file of pre-tokenized JSON lines")
    p.add_argument("--output", required=True, help="the store directory to create")
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--on-overlong", choices=("truncate", "drop"), default="truncate")
    p.add_argument("--min-loss-tokens", type=int, default=32)
    p.add_argument("--on-bad", choices=("fail", "skip"), default="fail")
    p.add_argument("--force", action="store_true", help="replace the output if it exists")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = p.parse_args()
    if args.max_len < 1:
        p.error("--max-len must be at least 1")

    s = prepare(args)
    if args.json:
        print(json.dumps(s))
    else:
        print(
            f"prepared {s['store']}: {s['samples']} samples, {s['tokens']} tokens "
            f"({s['loss_tokens']} loss tokens), {s['input_bytes'] / 1e6:.1f} MB in "
            f"{s['seconds']:.2f} s ({s['input_mb_per_s']:.1f} MB/s); truncated {s['truncated']}, "
            f"left out {sum(s['skipped'].values())} {s['skipped'] or ''}; checksum {s['checksum']}"
        )


if __name__ == "__main__":
    main()
