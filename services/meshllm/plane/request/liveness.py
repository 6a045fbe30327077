"""How long a Generate session, or one stream on it, may stay silent: `SessionLiveness`."""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.config import ConfigError

__all__ = ["SessionLiveness"]


@dataclass(frozen=True, slots=True)
class SessionLiveness:
    """When a client's Generate session, or one stream on it, counts as broken (plane/request/session.py).

    A session server sends a heartbeat (an empty `SessionDown`) whenever its
    streams are open and it sent nothing for `HEARTBEAT_S`, so a live peer is
    never silent for long, even while every stream waits for a long prefill.
    `step_s` below is the session's observed gap between messages (an
    exponential mean: one engine step when tokens flow, a heartbeat interval
    when none do).

    - A session with open streams that receives nothing at all for
      `max(stall_timeout_s, STALL_STEPS * step_s)` is broken: every stream
      fails with `Disconnected` (which the router migrates) and the call is
      cancelled.
    - A stream that has had its first chunk and then none for
      `max(stream_stall_timeout_s, STALL_STEPS * step_s)` fails the same way
      (0 = never): the peer answers, but this stream makes no progress.
    """

    stall_timeout_s: float = 3.0
    stream_stall_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1.0 <= self.stall_timeout_s <= 3600:  # also refuses NaN
            raise ConfigError(f"--stall-timeout must be between 1 and 3600 seconds, got {self.stall_timeout_s}")
        if not (self.stream_stall_timeout_s == 0 or 1.0 <= self.stream_stall_timeout_s <= 3600):
            raise ConfigError(
                f"--stream-stall-timeout must be 0 (off) or between 1 and 3600 seconds, got {self.stream_stall_timeout_s}"
            )
