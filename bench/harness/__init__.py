"""The harness every benchmark under bench/ runs on; the scripts beside this package are its scenarios.

- systems: `systems` (the mocker meshes bench/mesh.py compares, and Dynamo beside them), `servers` (any OpenAI
  server by its command line, a `meshllm run` or `meshllm frontend` until it serves, meshllm's ready lines),
  `probes` (readiness and metrics), `llamacpp` (the llama.cpp tier scenarios' engine flags);
- load: `meshllm.bench` (workloads, senders, replay, per-request records), shipped with meshllm itself so that
  `meshllm bench` and these scenarios send the same requests; `turns` (systems taking turns on the same requests);
- CPU sampling: `cpu` (whole process trees from /proc); statistics: `stats` (one percentile for every report, the
  median of what was measured, paired ratios with their bootstrap interval, and the cells that show them);
- reports: `runinfo` (what a report says about its own run, measured), `buildinfo` (the commit, packages and code
  fingerprint a mesh report names) and `doc` (each scenario's section of docs/benchmarks.md).

Scenarios run as `python bench/NAME.py`, which puts bench/ on sys.path, so they import `harness.…` and each other.
A scenario's long report lives beside it as `NAME_report.py`.
"""
