"""The model files a llamacpp worker serves through `Worker.GetModelFiles`.

A GGUF file carries its tokenizer; frontends without the file fetch a plain
Hugging Face tokenizer directory instead: `tokenizer.json` (the exact fast
tokenizer built from the GGUF metadata by `meshllm.tokenizers.gguf`,
cached on disk after the first build), `tokenizer_config.json` (chat template,
bos/eos tokens) and `generation_config.json` (every eos id). The engine
advertises `tokenizer_source = ""`, so the worker's model card points
frontends at these files (`worker:<id>`) rather than at a path that only
exists on the worker's machine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MODEL_FILES", "write_model_files"]

MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_model_files(gguf: Path, directory: Path, *, context_length: int, eos_token_ids: Sequence[int]) -> dict[str, Path]:
    """Write the tokenizer files of `gguf` into `directory` (blocking: run it in a thread)."""
    # Imported here: it pulls in `gguf` and `tokenizers`, which only this call needs.
    from meshllm.tokenizers.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(gguf)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token or None,
        "eos_token": tok.eos_token or None,
        "chat_template": tok.chat_template,
        "model_max_length": context_length,
        "add_bos_token": False,  # chat templates write their own special tokens
    }
    eos = list(dict.fromkeys([*tok.eos_token_ids, *eos_token_ids]))
    texts = {
        "tokenizer.json": tok.fast.to_str(),
        "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=1),
        "generation_config.json": json.dumps({"eos_token_id": eos}),
    }
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, text in texts.items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        files[name] = path
    return files
