#!/usr/bin/env python3
"""Reads TensorBoard event files with TensorBoard's own reader (EventAccumulator), as the
TensorBoard UI would, and prints every scalar as JSON:

    {"tags": {"train/loss": [[step, value], ...], ...}}

Usage: read_tensorboard.py EVENT_FILE_OR_DIR
(a directory reads all its event files; a non-finite value is printed as "nan", "inf" or "-inf")
"""

import json
import math
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def number(value):
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: read_tensorboard.py EVENT_FILE_OR_DIR")
    path = Path(sys.argv[1])
    if not path.exists():
        sys.exit(f"{path}: no such file or directory")
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = {
        tag: [[e.step, number(e.value)] for e in acc.Scalars(tag)]
        for tag in sorted(acc.Tags()["scalars"])
    }
    json.dump({"tags": tags}, sys.stdout, allow_nan=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
