"""The frames of TCP Generate sessions (meshllm.plane.request.tcp_session) and the `--session-port` flag."""

from __future__ import annotations

import pytest

from meshllm.config import ConfigError, ServerConfig, server_config
from meshllm.errors import InvalidArgument
from meshllm.plane.request.tcp_frames import DOWN, END, HELLO, UP, FrameReader, encode_frame
from meshllm.router.config import router_arg_parser


def test_frames_split_anywhere_across_reads_come_out_whole_and_in_order() -> None:
    frames = [(HELLO, b'{"service": "Worker"}'), (UP, b""), (DOWN, bytes(range(256)) * 40), (END, b"{}")]
    stream = b"".join(encode_frame(k, p) for k, p in frames)
    for step in (1, 3, 5, 4096, len(stream)):
        reader = FrameReader(max_bytes=1 << 20)
        out = []
        for at in range(0, len(stream), step):
            out += reader.feed(stream[at : at + step])
        assert out == frames, step


@pytest.mark.parametrize(
    "data", [encode_frame(DOWN, b"x" * 101), encode_frame(0, b""), encode_frame(9, b"")], ids=["too-big", "kind-0", "kind-9"]
)
def test_a_frame_over_the_limit_or_of_no_known_kind_is_refused_from_its_header(data: bytes) -> None:
    reader = FrameReader(max_bytes=100)
    with pytest.raises(InvalidArgument, match="bad session frame"):
        reader.feed(data[:5])  # the header alone decides: nothing of an oversized body is buffered first


def test_session_port_is_ephemeral_by_default_minus_one_is_off_and_other_values_are_checked_at_startup() -> None:
    from meshllm.engine.worker_config import worker_arg_parser

    parse = worker_arg_parser("mocker", env={}).parse_known_args
    assert server_config(parse([])[0]).session_port == 0
    assert server_config(parse(["--session-port", "-1"])[0]).session_port is None
    env_ns = worker_arg_parser("mocker", env={"MESHLLM_SESSION_PORT": "7001"}).parse_known_args([])[0]
    assert server_config(env_ns).session_port == 7001
    with pytest.raises(ConfigError, match="--session-port 70000 is out of range"):
        server_config(parse(["--session-port", "70000"])[0])
    with pytest.raises(ConfigError, match="--session-port -2 is out of range"):
        ServerConfig(session_port=-2)
    # The router has the same flag (its frontends learn the port from its discovery record).
    assert server_config(router_arg_parser(env={}).parse_args(["--session-port", "0"])).session_port == 0
