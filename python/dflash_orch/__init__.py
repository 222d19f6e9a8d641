"""The PyTorch engine of dflash-orch.

The Rust worker (`dflash-worker`) keeps everything a run's correctness rests on: the rings, the
descriptors, heartbeats and supervision. It starts `python -m dflash_orch.serve` as a child and
hands it one job at a time over a pipe: the tokens of a batch and where in the mapped feature slot
to write their hidden states (a file and a byte range that Rust computed; this package never reads
a ring header). See `serve.py` for the protocol.
"""

__version__ = "0.1.0"

# The version of the pipe protocol between dflash-worker and `dflash_orch.serve`: both are built
# from one tree, but a stale installed package is refused rather than misread. 2: every request
# carries an id that its answer names.
PROTOCOL = 2
