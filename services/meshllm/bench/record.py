"""One request as `meshllm bench` measured it: `RequestRecord` (summarized by `bench.report`, judged by `bench.slo`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RequestRecord"]


@dataclass(slots=True)
class RequestRecord:
    """One request's timings (seconds) and token counts."""

    ttft: float | None = None
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the endpoint reports it
    events: int = 0  # SSE events that carried text
    error: str | None = None
    intended_prompt_tokens: int | None = None  # what the generator built the prompt to count, when it knows

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than two tokens."""
        if self.error is not None or self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def mean_itl(self) -> float | None:
        """This request's mean gap between events with text; None with fewer than two events."""
        return sum(self.gaps) / len(self.gaps) if self.gaps else None
