"""What this Python offers the torch engine, as one JSON line on stdout.

`dflash-orch` runs `python -m dflash_orch.preflight` before a launch that uses the torch engine
and judges the answer itself (the minimum versions live in one place, the orchestrator). Nothing
here fails: a missing module is reported as null with the reason.
"""

import json
import sys


def _version_of(module_name):
    try:
        module = __import__(module_name)
    except Exception as e:  # an import can fail in more ways than ImportError
        return None, f"{type(e).__name__}: {e}"
    return getattr(module, "__version__", "unknown"), None


def report():
    import dflash_orch

    out = {
        "python": ".".join(str(x) for x in sys.version_info[:3]),
        "executable": sys.executable,
        "package": dflash_orch.__version__,
        "package_path": dflash_orch.__file__,
        "protocol": dflash_orch.PROTOCOL,
    }
    for name in ("torch", "transformers", "safetensors"):
        version, why = _version_of(name)
        out[name] = version
        if why:
            out[f"{name}_error"] = why
    out["cuda_available"] = False
    out["cuda_devices"] = 0
    out["cuda_version"] = None
    if out["torch"] is not None:
        import torch

        try:
            out["cuda_available"] = bool(torch.cuda.is_available())
            out["cuda_devices"] = torch.cuda.device_count() if out["cuda_available"] else 0
        except Exception as e:
            out["cuda_error"] = f"{type(e).__name__}: {e}"
        out["cuda_version"] = torch.version.cuda
        out["attention"] = ["sdpa"] + (["flex"] if _has_flex() else [])
    return out


def _has_flex():
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except Exception:
        return False
    return True


if __name__ == "__main__":
    print(json.dumps(report()), flush=True)
