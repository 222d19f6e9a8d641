"""The torch drafter's elementwise chains, eager or compiled (`--drafter-compile`).

Eager mode runs RMSNorm, rotary embedding, SiLU gating and the loss's softmax gradient as one
kernel per operation, each reading and writing its whole tensor; at the seeds' shape that is a
fifth of the drafter's device time (`scripts/bench-step-account`). `torch.compile` fuses each
chain below into one or two kernels, forward and backward. The eager functions are the
drafter's own arithmetic, operation for operation, so a run without compile computes exactly
what it did before; the compiled ones compute the same values up to float rounding.

`compiled()` compiles them once per process, in Inductor's deterministic mode (the same
kernels in every process, so a restarted drafter replays its steps to the bit), and runs each
once on small tensors, so a failure to compile shows at start-up (the drafter then runs eagerly
and says why) and the cost of compiling is known: `compile_s`.
"""

import time

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps: float):
    """RMSNorm in f32 whatever `x`'s dtype, returned in `x`'s dtype (`weight` an f32 master)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * weight).to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def norm_rope(x, weight, eps: float, cos, sin):
    """A head-wise RMSNorm and the rotary embedding after it (queries' and keys')."""
    x = rms_norm(x, weight, eps)
    return x * cos + rotate_half(x) * sin


def add_norm(x, out, weight, eps: float):
    """The residual sum and the RMSNorm of it: (`x + out`, its norm)."""
    x = x + out
    return x, rms_norm(x, weight, eps)


def swiglu(gate, up):
    return F.silu(gate) * up


def ce_rows(logits, targets, acc: torch.dtype):
    """Of full-vocabulary `logits` `[n, vocab]` (compute dtype): each row's log-sum-exp and
    cross-entropy on `targets` `[n]` in `acc`, and whether its greedy pick is the target."""
    lse = torch.logsumexp(logits.to(acc), dim=-1)
    ce = lse - logits.gather(1, targets.unsqueeze(1)).squeeze(1).to(acc)
    return lse, ce, logits.argmax(-1) == targets


def ce_grad(logits, targets, lse, wscale, dtype: torch.dtype):
    """d(sum w * ce) / d logits = w * (softmax - onehot), in `acc` and rounded once to `dtype`;
    `wscale` `[n]` is each row's weight times the loss scale."""
    p = torch.exp(logits.to(lse.dtype) - lse.unsqueeze(1))
    hot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == targets.unsqueeze(1)
    return ((p - hot.to(p.dtype)) * wscale.unsqueeze(1)).to(dtype)


class Kernels:
    """The chains a drafter calls: eager (`EAGER`) or compiled (`compiled()`). `fused_ce` says
    whether the loss takes its softmax gradient from `ce_rows` and `ce_grad` (compiled) or
    computes it operation by operation (`blocks.LinearCE`'s eager arithmetic)."""

    def __init__(self, fns, fused_ce, compile_s=None, why=None):
        self.norm_rope = fns["norm_rope"]
        self.add_norm = fns["add_norm"]
        self.rms_norm = fns["rms_norm"]
        self.swiglu = fns["swiglu"]
        self.ce_rows = fns["ce_rows"]
        self.ce_grad = fns["ce_grad"]
        self.fused_ce = fused_ce
        self.compile_s = compile_s
        self.why = why

    @property
    def label(self):
        if self.fused_ce:
            return f"compiled ({self.compile_s:.1f} s)"
        return "eager" + (f" (compile failed: {self.why})" if self.why else "")


_FNS = {"norm_rope": norm_rope, "add_norm": add_norm, "rms_norm": rms_norm, "swiglu": swiglu,
        "ce_rows": ce_rows, "ce_grad": ce_grad}
EAGER = Kernels(_FNS, fused_ce=False)
_COMPILED = {}


def _warm(k, device, dtype):
    """Each compiled chain once, forward and backward, on small tensors of the run's dtype (sizes
    above 1, which `torch.compile` would specialise)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=True, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt).requires_grad_(grad)

    w = t(8, dt=torch.float32)
    # The ranks the drafter calls them with: the context's `[tokens, heads, head_dim]` and
    # `[tokens, hidden]`, the blocks' `[anchors, block, heads, head_dim]` and `[anchors, block,
    # hidden]` (another rank is another graph).
    for lead in ((3,), (3, 4)):
        cos, sin = t(*lead, 1, 8, grad=False), t(*lead, 1, 8, grad=False)
        k.norm_rope(t(*lead, 2, 8), w, 1e-6, cos, sin).float().sum().backward()
        k.rms_norm(t(*lead, 8), w, 1e-6).float().sum().backward()
    y, n = k.add_norm(t(3, 4, 8), t(3, 4, 8), w, 1e-6)
    (y.float().sum() + n.float().sum()).backward()
    k.swiglu(t(3, 4, 8), t(3, 4, 8)).float().sum().backward()
    with torch.no_grad():
        logits = t(6, 32, grad=False)
        targets = torch.arange(6, device=device) % 32
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        lse, _, _ = k.ce_rows(logits, targets, acc)
        k.ce_grad(logits, targets, lse, torch.ones(6, dtype=acc, device=device), dtype)


def deterministic_compile(fn):
    """`torch.compile(fn, dynamic=True)` in Inductor's deterministic mode, which skips the
    on-device benchmarking that picks a reduction's block size and warps per process (a pick
    that changes the sums' order, so their last bits, between a run and its restart: exact
    replay needs the same kernels in every process). Raises where this torch has no such mode."""
    import torch._inductor.config as inductor

    if not hasattr(inductor, "deterministic"):
        raise RuntimeError(f"torch {torch.__version__}'s Inductor has no deterministic mode, "
                           "which exact replay needs")
    return torch.compile(fn, dynamic=True, options={"deterministic": True})


def compiled(device, dtype):
    """The chains compiled for `device` and `dtype` (once per process); `EAGER` with the reason
    where compiling fails."""
    key = (device.type, dtype)
    if key not in _COMPILED:
        start = time.perf_counter()
        try:
            fns = {name: deterministic_compile(fn) for name, fn in _FNS.items()}
            k = Kernels(fns, fused_ce=True)
            _warm(k, device, dtype)
            k.compile_s = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager chains
            first = (str(e).strip().splitlines() or [""])[0][:300]
            k = Kernels(_FNS, fused_ce=False, why=f"{type(e).__name__}: {first}")
        _COMPILED[key] = k
    return _COMPILED[key]
