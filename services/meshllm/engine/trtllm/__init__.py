"""The `trtllm` engine: TensorRT-LLM behind the LLMEngine contract (TensorRT-LLM itself is imported lazily).

Modules: `config` (flags, `--extra-engine-args` YAML, `tensorrt_llm.LLM` kwargs),
`translate` (requests → SamplingParams / DisaggregatedParams kwargs, cumulative
outputs → deltas, finish reasons, usage), `kv_events` (KV cache events and
iteration stats → EngineSink), `engine` (`TrtllmEngine`). See docs/engines/trtllm.md.
"""
