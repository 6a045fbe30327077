"""The vllm engine's pure parts, without vLLM: requests → SamplingParams keywords, finish reasons, logprobs, KV event
batches → router hashes (with a resync on a lost batch), and the flags' one-line errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from meshllm.config import ConfigError, EnvArgumentParser
from meshllm.engine.cpus import cpu_shares, format_cpu_list
from meshllm.engine.vllm import config as vllm_config
from meshllm.engine.vllm import engine as vllm_engine
from meshllm.engine.vllm.config import BIND_ENV, VllmConfig, add_vllm_args, cpu_environment, engine_kwargs
from meshllm.engine.vllm.engine import VllmEngine
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


def test_cpu_bind_sets_vllms_thread_binding_and_bad_lists_stop_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: --cpu-bind wins over the operator's VLLM_CPU_OMP_THREADS_BIND, which wins over auto (every usable CPU,
    not vLLM's own auto that keeps one free); a malformed list or a CPU outside the affinity mask is a ConfigError."""
    monkeypatch.setattr(vllm_config, "usable_cpus", lambda: [0, 1, 2, 3])
    assert cpu_environment(parse([]), operator={})[BIND_ENV] == "0-3"
    assert cpu_environment(parse([]), operator={BIND_ENV: "2"})[BIND_ENV] == "2"
    assert cpu_environment(parse(["--cpu-bind", "1,3"]), operator={BIND_ENV: "2"})[BIND_ENV] == "1,3"
    env = cpu_environment(parse(["--cpu-bind", "0-1", "--kv-cache-space", "2"]), operator={"VLLM_HOST_IP": "10.0.0.1"})
    assert env == {BIND_ENV: "0-1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "10.0.0.1"}
    for bad in ("x", "3-1", "-1", "0,,1"):
        with pytest.raises(ConfigError, match="give auto or a CPU list"):
            parse(["--cpu-bind", bad])
    with pytest.raises(ConfigError, match=r"CPU\(s\) 4-5 are not among the CPUs this process may use \(0-3\)"):
        parse(["--cpu-bind", "3-5"])


def test_several_vllm_workers_of_one_process_get_disjoint_cpu_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: meshllm run's workers split the usable CPUs (two engines pinned to the same cores oversubscribe them);
    flags or the operator's binding are left alone, as are more workers than CPUs."""
    assert cpu_shares([0, 1], 2) == ["0", "1"]
    assert cpu_shares([0, 1, 2, 3, 4], 2) == ["0-2", "3-4"]
    assert cpu_shares([0, 2, 4, 6], 2) == ["0,2", "4,6"]
    assert cpu_shares([0, 1], 3) is None and cpu_shares([0, 1], 1) is None
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    monkeypatch.setattr(vllm_engine, "usable_cpus", lambda: [0, 1])
    monkeypatch.setattr(vllm_engine, "operator_env", dict)
    monkeypatch.delenv("MESHLLM_CPU_BIND", raising=False)
    argv = ["--max-num-seqs", "4"]
    assert [VllmEngine.instance_args(argv, i, 2) for i in range(2)] == [[*argv, "--cpu-bind", "0"], [*argv, "--cpu-bind", "1"]]
    assert VllmEngine.instance_args(argv, 0, 1) == argv
    assert VllmEngine.instance_args([*argv, "--cpu-bind=0-1"], 1, 2) == [*argv, "--cpu-bind=0-1"]
    monkeypatch.setattr(vllm_engine, "operator_env", lambda: {BIND_ENV: "0-1"})
    assert VllmEngine.instance_args(argv, 1, 2) == argv
