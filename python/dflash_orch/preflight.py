"""What this Python offers the torch engine, as one JSON line on stdout.

`dflash-orch` runs `python -m dflash_orch.preflight` before a launch that uses the torch engine
and judges the answer itself (the minimum versions live in one place, the orchestrator). Nothing
here fails: a missing module is reported as null with the reason. With `--model DIR`, the report
also says whether transformers can load DIR as a causal LM (`model_error`, null when it can).
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


def model_error(model_dir):
    """Why transformers cannot load `model_dir` as a causal LM (its config and architecture; no
    weights are read), or None."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return (f"its config ({type(config).__name__}, model_type "
                f"{getattr(config, 'model_type', '?')!r}) is not a causal LM transformers knows")
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


if __name__ == "__main__":
    out = report()
    if len(sys.argv) == 3 and sys.argv[1] == "--model" and out["transformers"] is not None:
        out["model_error"] = model_error(sys.argv[2])
    print(json.dumps(out), flush=True)
