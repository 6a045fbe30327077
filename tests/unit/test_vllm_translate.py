"""The vllm engine's pure parts, without vLLM: requests → SamplingParams keywords, finish reasons, logprobs, KV event
batches → router hashes (with a resync on a lost batch), and the flags' one-line errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from meshllm.config import ConfigError, EnvArgumentParser
from meshllm.engine.vllm.config import VllmConfig, add_vllm_args, engine_kwargs
from meshllm.engine.vllm.kv_events import VllmKvEvents
from meshllm.engine.vllm.translate import logprob_items, map_finish, prompt_logprob_items, sampling_kwargs
from meshllm.errors import InvalidArgument
from meshllm.protocol.kv import block_hashes
from meshllm.testing.conformance.kit import RecordingSink


@dataclass
class Lp:
    logprob: float
    rank: int | None


def test_a_request_becomes_sampling_keywords() -> None:
    kw = sampling_kwargs(
        {
            "request_id": "r", "token_ids": [1, 2, 3],
            "sampling": {
                "temperature": 0.5, "top_k": 0, "top_p": 0.9, "seed": 7, "guided": {"json_schema": '{"type": "object"}'},
            },
            "stop": {"max_tokens": 5000, "min_tokens": 2, "stop_token_ids": [9], "ignore_eos": True},
            "output": {"logprobs": 3, "prompt_logprobs": 1},
        },
        context_length=100, prompt_len=3,
    )  # fmt: skip
    assert kw == {
        "temperature": 0.5, "top_p": 0.9, "seed": 7, "max_tokens": 97, "min_tokens": 2, "stop_token_ids": [9],
        "ignore_eos": True, "logprobs": 3, "prompt_logprobs": 1, "structured_outputs": {"json": {"type": "object"}},
    }  # fmt: skip
    with pytest.raises(InvalidArgument, match="context"):
        sampling_kwargs({"request_id": "r", "token_ids": [1] * 100}, context_length=100, prompt_len=100)


def test_finish_reasons_and_the_stop_token() -> None:
    assert map_finish("stop", None, [5, 2]) == ("eos", "", [5, 2])  # EOS is emitted
    assert map_finish("stop", 9, [5, 9]) == ("stop", "9", [5])  # a stop token id is not
    assert map_finish("length", None, [5]) == ("length", "", [5])
    assert map_finish("abort", None, []) == ("cancelled", "", [])
    assert map_finish("error", "boom", [])[0] == "error"


def test_logprobs_keep_the_ranked_alternatives() -> None:
    step = {7: Lp(-0.5, 2), 3: Lp(-0.1, 1), 4: Lp(-3.0, 3)}
    (item,) = logprob_items([step], [7], 2)
    assert item == {"token_id": 7, "logprob": -0.5, "top": [(3, -0.1), (7, -0.5)]}
    prompt = prompt_logprob_items([None, {11: Lp(-1.0, 4), 12: Lp(-0.2, 1)}], [10, 11], 1)
    assert prompt == [{"token_id": 11, "logprob": -1.0, "top": [(12, -0.2)]}]


def test_kv_event_batches_become_router_hashes_and_a_lost_batch_resyncs() -> None:
    sink = RecordingSink()
    kv = VllmKvEvents(sink, block_size=4, endpoint="ipc:///nowhere")
    tokens = list(range(100, 112))
    stored = {"type": "BlockStored", "block_hashes": [901, 902, 903], "parent_block_hash": None, "token_ids": tokens,
              "block_size": 4, "medium": "GPU"}  # fmt: skip
    kv.feed(0, [stored], 0)
    assert sink.held[0] == set(block_hashes(tokens, 4))
    kv.feed(1, [{"type": "BlockRemoved", "block_hashes": [903], "medium": "GPU"}], 0)
    assert sink.held[0] == set(block_hashes(tokens, 4)[:2])
    kv.feed(2, [{"type": "BlockStored", "block_hashes": [904], "parent_block_hash": 1, "token_ids": [1, 2, 3, 4],
                 "block_size": 4, "medium": "CPU"}], 0)  # fmt: skip
    assert sink.held[0] == set(block_hashes(tokens, 4)[:2])  # another medium: not the router's
    kv.feed(5, [{"type": "AllBlocksCleared"}], 0)  # batches 3-4 were lost: resync first, then clear
    assert kv.converter.stats.gaps == 1 and len(sink.cleared) == 2 and sink.held[0] == set()


def parse(argv: list[str]) -> VllmConfig:
    parser = EnvArgumentParser(env={})
    add_vllm_args(parser)
    parser.add_argument("--model-name", default=None)
    return VllmConfig.from_namespace(parser.parse_args(argv), cpu=True)


def test_flags_are_checked_with_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="multiple of 32"):
        parse(["--block-size", "16"])
    with pytest.raises(ConfigError, match=r"config\.json"):
        parse(["--model-path", str(tmp_path)])
    with pytest.raises(ConfigError, match="not JSON"):
        parse(["--extra-engine-args", "{nope"])
    cfg = parse(["--extra-engine-args", '{"max_model_len": 4096}'])
    with pytest.raises(ConfigError, match="set it once"):
        engine_kwargs(cfg, tmp_path, "m", "ipc:///x")
    kw = engine_kwargs(parse(["--block-size", "64"]), tmp_path, "m", "ipc:///x")
    assert kw["block_size"] == 64 and kw["kv_events_config"]["endpoint"] == "ipc:///x" and kw["enforce_eager"]
