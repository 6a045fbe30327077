"""Tokenizer files shared by the frontend and the engines: Hugging Face directories and GGUF metadata.

A lower package than both: the frontend loads tokenizers from here
(`meshllm.frontend.text.tokenizer`), and the llamacpp engine builds the tokenizer
files it serves (`Worker.GetModelFiles`) with the same GGUF builder and cache.
Imports only `config` and `errors`.
"""
