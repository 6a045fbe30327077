"""The engine conformance kit: plain async checks of every `LLMEngine` clause.

Usable without pytest:

    report = await run_conformance(factory_for(MyEngine, ["--my-flag", "x"]))
    print(report.summary())
    report.raise_if_failed()

or from the command line, `python -m meshllm.testing.conformance mypkg.engine:MyEngine -- --my-flag x`,
or through the pytest plugin, `pytest --meshllm-engine mypkg.engine:MyEngine`.

Every check takes an *engine factory* (an async callable returning a fresh,
constructed-but-not-started engine), builds its own engine, gives it a
`RecordingSink`, and cleans it up afterwards, so a broken clause fails only its
own check. `run_conformance(..., share_engine=True)` instead runs the clauses
that only serve requests (`SHAREABLE_CLAUSES`) in turn on one started engine, as
a server uses it, for engines that take long to start. A check raises `ConformanceError(clause, message)`; every engine call
runs under a timeout, so a hanging engine fails a check instead of hanging the kit.

Assumption about outputs: the kit never predicts token ids. It requests greedy
decoding (temperature 0, seed 0) and learns the engine's output by running a
request first. Where a clause compares two runs (stop tokens, concurrent
streams) and the engine does not reproduce its own output, the check falls back
to the properties that hold for any output (the stop token is never emitted;
every stream ends with a proper terminal) and records a note saying so.

Optional features: the KV tier clauses (`TIER_CLAUSES`) run only on engines
whose `EngineConfig.kv_tiers` is not empty; on others the check reports the
clause skipped (`CheckResult.skipped`, "SKIP" in the summary, a pytest skip
in the plugin), which counts as passed. See `tier_checks` for what an engine
with tiers needs (a device cache small enough for the kit to fill).
"""

from meshllm.testing.conformance import kit, runner
from meshllm.testing.conformance.checks import CHECKS
from meshllm.testing.conformance.kit import *  # noqa: F403 - the kit's vocabulary, as kit.__all__ lists it
from meshllm.testing.conformance.runner import *  # noqa: F403 - running checks, as runner.__all__ lists them

__all__ = ["CHECKS"]
__all__ += kit.__all__
__all__ += runner.__all__
