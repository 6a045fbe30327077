"""The mocker's timing model: how long a simulated engine step and a KV transfer take.

The curves are polynomial fits of a vLLM-served ~8B model on one datacenter
GPU (the baseline of the usual LLM serving simulators):

    prefill ms = 4.209989e-7·T² + 1.518344e-2·T + 16.50142    T = the step's new (uncached) prompt tokens
    decode ms  = −25.74·p² + 54.01·p + 5.74                     p = fraction of KV blocks in use

A step that carries both prefill chunks and decoding sequences costs the
*sum*: the decode tokens ride in the same forward pass, but the pass is as
long as its prefill part plus the attention over the decoding sequences' KV.
Summing keeps mixed steps at least as slow as either part alone, so a burst
of new prompts visibly slows running streams (inter-token latency spikes), as
it does on a real chunked-prefill engine. Every duration is divided by the
speedup ratio; a ratio of 0 means "no delay at all".

Restoring blocks from a lower KV tier (host memory, disk) costs
`blocks × block_bytes / bandwidth` per tier (`restore_seconds`), summed over
the tiers a prompt's prefix comes from, and added to the step that prefills
the rest of that prompt (the prefix is loaded before the forward pass that
needs it, so the whole batch waits for it; summing is the conservative
choice where an engine overlapping loads layer by layer pays about the
larger of the two). At the defaults (64-token blocks of an fp16 Llama-3-8B, 8 MiB;
host 25 GB/s, about PCIe 4.0 x16; disk 10 GB/s, a few NVMe drives) a
512-token prefix restores in 2.7 ms from host and 6.7 ms from disk against
24 ms to prefill it, and 8,192 tokens in 43 and 107 ms against 169 ms. A
single NVMe drive (~5 GB/s) restores long prefixes slower than the prefill
curve computes them (from ~1,900 tokens on); the mocker restores anyway,
so set --kv-disk-bandwidth to what the modelled hardware reads.

`StepPacer` keeps back-to-back steps on the model's timeline. An event
loop's timers are coarse (libuv counts whole milliseconds) and wake late, so
sleeping each step's duration from the moment the step started loses the
overshoot on every step: at --speedup-ratio 10 a busy mocker ran its steps
~65 % slower than its own model. The pacer starts a step where the last one
was due to end, so one late wake-up shortens the next sleep instead of
delaying every later token; after an idle period, or a lag too large to be a
timer's (a stalled process), the timeline restarts at the present.

A step whose end on the timeline has already passed when it is computed (the
event loop ran other work meanwhile: a frontend's streams in `meshllm run`)
ends at once, without a yield, and so may the next ones, for at most
`engine.MAX_BURST_S` of the process's time: a GPU would have run them while
the process was busy, so their tokens join those its streams have not taken
yet. Without this the simulated engine would advance one step per turn of
its streams' consumers, as slow as the process around it.
"""

from __future__ import annotations

__all__ = ["MAX_LAG_S", "StepPacer", "decode_ms", "prefill_ms", "restore_seconds", "step_ms", "transfer_seconds"]

# The most a step may start behind its due time and still be caught up: a timer's overshoot, not a stall.
MAX_LAG_S = 0.005


def prefill_ms(tokens: int) -> float:
    """Milliseconds to prefill `tokens` new prompt tokens in one step (0 tokens cost nothing)."""
    if tokens <= 0:
        return 0.0
    return 4.209989e-7 * tokens * tokens + 1.518344e-2 * tokens + 16.50142


def decode_ms(kv_usage: float) -> float:
    """Milliseconds of one decode step when a fraction `kv_usage` (0..1) of KV blocks is in use."""
    p = min(max(kv_usage, 0.0), 1.0)
    return -25.74 * p * p + 54.01 * p + 5.74


def step_ms(prefill_tokens: int, decoding: bool, kv_usage: float) -> float:
    """Model milliseconds of one step (before the speedup ratio): prefill part plus decode part."""
    ms = prefill_ms(prefill_tokens)
    if decoding:
        ms += decode_ms(kv_usage)
    return ms


def transfer_seconds(tokens: int, bytes_per_token: int, bandwidth_gbps: float, speedup: float) -> float:
    """Simulated time to move `tokens` tokens of KV at `bandwidth_gbps` GB/s (0 bandwidth = instant)."""
    if bandwidth_gbps <= 0 or speedup <= 0 or tokens <= 0:
        return 0.0
    return tokens * bytes_per_token / (bandwidth_gbps * 1e9) / speedup


def restore_seconds(blocks: int, block_bytes: int, bytes_per_s: float, speedup: float) -> float:
    """Simulated time to restore `blocks` blocks of `block_bytes` from a tier read at `bytes_per_s` (speedup 0 = instant)."""
    if blocks <= 0 or bytes_per_s <= 0 or speedup <= 0:
        return 0.0
    return blocks * block_bytes / bytes_per_s / speedup


class StepPacer:
    """When each simulated step ends, so that busy steps follow the timing model on average (see above)."""

    __slots__ = ("_due", "max_lag_s")

    def __init__(self, max_lag_s: float = MAX_LAG_S) -> None:
        self.max_lag_s = max_lag_s
        self._due: float | None = None  # when the previous step was due to end; None = idle, no timeline

    def step_end(self, started: float, step_s: float) -> float:
        """When a `step_s`-long step that began (its compute) at `started` ends on the model's timeline.

        Back to back with the previous step (at most `max_lag_s` behind, or early), it starts where that one
        was due to end; otherwise at `started`. The caller waits until the returned time.
        """
        due = self._due
        start = due if due is not None and started - due <= self.max_lag_s else started
        self._due = start + step_s
        return self._due

    def idle(self) -> None:
        """The engine ran out of work: the next step starts a new timeline."""
        self._due = None
