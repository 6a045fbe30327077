"""The SLA planner: scales prefill and decode workers to TTFT and ITL targets (docs/planner.md)."""
