"""lm-evaluation-harness (`lm_eval` from PyPI, model `local-completions`) scoring a log-likelihood task through
`meshllm run --engine llamacpp` (SmolLM2-135M), each answer checked against llama-cpp-python on the same GGUF.

The task is written into tmp_path: a YAML `multiple_choice` task over a local
JSONL file (8 questions x 3 choices = 24 log-likelihood requests). lm_eval
runs unmodified through its Python API (`simple_evaluate`), with the tokenizer
backend it picks by itself: `remote`, meshllm's vLLM-style /tokenizer_info,
/tokenize and /detokenize. It sends each (context, continuation) as token ids to
/v1/completions with `echo`, `logprobs: 1`, `max_tokens: 1` and sums
`token_logprobs[len(context):-1]`.

The reference for each pair is llama-cpp-python's own
`Llama(logits_all=True).create_completion(context + continuation, echo=True,
logprobs=1, max_tokens=1)`, summed over the continuation's tokens. Its
`token_logprobs` pair prompt token i with the distribution *after* token i
(abetlen/llama-cpp-python#1983, locked below so a fix upstream is noticed), so
the sum is taken from the logits that same call computed (`Llama.scores`),
token i scored with the distribution after token i - 1, which is what lm_eval
and the OpenAI API mean.

Tolerance 1e-4 per continuation token: both sides run the same llama.cpp
kernels (flash attention, the whole prompt in one batch of the default 512, so
the CPU matmuls take the same paths) on the same ids. What differs is the
log-softmax: float32 in llama-cpp-python, float64 in the engine (measured
per-token differences ≤ ~1e-6, tests/integration/test_llamacpp_prompt_logprobs.py),
and the thread count, which splits a matmul's rows between threads but not the
summation order inside a row. Measured on the 24 sums here (the test prints
them with `pytest -s`): at most 6.4e-7 apart, the same with the engine on 2
threads and with 2 concurrent requests of 4 prompts (the single-token choices
of a question mostly differ by the same amount: the shared log-softmax
normalizer, not the logits). With the reference's flash attention off they are
up to 0.27 apart, so 1e-4 also proves the kernels match.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mesh_run import MeshRun
from test_llamacpp_support import MODEL, require_model

require_model()
pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOLERANCE_PER_TOKEN = 1e-4
TASK = "meshllm_loglikelihood"
ITEMS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "Bees make", "choices": ["honey from nectar", "steel beams", "glass windows"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit", "Kelvin"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["cold.", "warm, not cold.", "a loud noise."], "answer": 0},
    {"question": "One, two, three, four,", "choices": ["five", "seven", "ten"], "answer": 0},
    {"question": "The French word for coffee is", "choices": ["café", "thé", "lait"], "answer": 0},
    {"question": "The largest city in the United States is", "choices": ["New York City", "Los Angeles", "Chicago"], "answer": 0},
    {"question": "Question: What colour is a clear sky?\nAnswer:", "choices": ["blue", "green", "purple"], "answer": 0},
]
TASK_YAML = """\
task: meshllm_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def mesh() -> Iterator[MeshRun]:
    with MeshRun.start("--engine", "llamacpp", "--workers", "1", "--", "--n-ctx", "512", "--n-seq-max", "4") as m:
        yield m


@pytest.fixture(scope="module")
def reference() -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(MODEL), logits_all=True, n_ctx=512, flash_attn=True, n_threads=1, verbose=False)


def reference_loglikelihood(llm: Any, context: str, continuation: str) -> tuple[float, bool, int]:
    """(sum of the continuation's token logprobs, whether each is the argmax, its token count) from llama-cpp-python's
    create_completion(echo=True, logprobs=1) on context + continuation, split into tokens as lm_eval splits them."""
    import llama_cpp

    whole = llm.tokenize((context + continuation).encode(), add_bos=True)
    start = len(llm.tokenize(context.encode(), add_bos=True))
    assert 0 < start < len(whole)
    llm.reset()  # no prefix reuse: every position is evaluated in this call's one batch
    out = llm.create_completion(context + continuation, max_tokens=1, echo=True, logprobs=1, temperature=0.0)
    logprobs = llama_cpp.Llama.logits_to_logprobs(llm.scores[: len(whole)])
    own = out["choices"][0]["logprobs"]["token_logprobs"]
    # abetlen/llama-cpp-python#1983: its token_logprobs[i] score token i with the distribution after token i
    assert all(abs(own[p] - float(logprobs[p][whole[p]])) < 1e-6 for p in range(1, len(whole))), "#1983 fixed?"
    total = sum(float(logprobs[p - 1][whole[p]]) for p in range(start, len(whole)))
    greedy = all(int(logprobs[p - 1].argmax()) == whole[p] for p in range(start, len(whole)))
    return total, greedy, len(whole) - start


def write_task(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in ITEMS), encoding="utf-8")
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.replace("DATA", json.dumps(str(data))), encoding="utf-8")
    return tasks


@pytest.mark.parametrize(("num_concurrent", "batch_size"), [(1, 1), (2, 4)], ids=["sequential", "concurrent-batched"])
def test_lm_eval_loglikelihoods_through_the_mesh_equal_llama_cpp_pythons(
    mesh: MeshRun, reference: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_concurrent: int, batch_size: int
) -> None:
    """Locks: the sums lm_eval reads from /v1/completions are llama-cpp-python's, one request at a time and with
    several prompts per request (`prompt` a list of token-id lists, choices matched by `index`) sent concurrently,
    so prompts can meet in one engine batch."""
    # datasets reads these when imported: its cache under tmp_path, never the network
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    base_url = f"{mesh.http_url}/v1/completions"
    model = json.loads(_get(f"{mesh.http_url}/v1/models"))["data"][0]["id"]
    model_args = {"model": model, "base_url": base_url, "num_concurrent": num_concurrent, "max_retries": 1, "max_length": 512}
    # the tokenizer backend lm_eval picks by itself is the mesh's (no local tokenizer files): /tokenizer_info
    # names the tokens, /tokenize gives their ids (lm_eval's eos id is encode(eos_token)[0])
    probe = get_model("local-completions")(**model_args)
    assert probe.tokenizer_backend == "remote" and probe.eot_token_id == reference.token_eos()
    results = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(write_task(tmp_path)), include_defaults=False),
        batch_size=batch_size,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == ITEMS

    rows: list[tuple[str, str, int, float, float]] = []
    correct = 0
    for sample in samples:
        pairs = [tuple(a) for a in sample["arguments"]]
        assert [cont for _, cont in pairs] == [" " + c for c in sample["doc"]["choices"]]  # target_delimiter " "
        got = [resp[0] for resp in sample["resps"]]
        ref = [reference_loglikelihood(reference, ctx, cont) for ctx, cont in pairs]
        for (ctx, cont), (ll, greedy), (ref_ll, ref_greedy, n) in zip(pairs, got, ref, strict=True):
            rows.append((ctx, cont, n, ll, ll - ref_ll))
            assert abs(ll - ref_ll) < TOLERANCE_PER_TOKEN * n, (ctx, cont, ll, ref_ll)
            assert greedy == ref_greedy, (ctx, cont)
        correct += max(range(len(ref)), key=lambda i: ref[i][0]) == sample["doc"]["answer"]
    assert len(rows) == 24 and any(n > 1 for _, _, n, _, _ in rows)
    assert results["results"][TASK]["acc,none"] == pytest.approx(correct / len(ITEMS))
    report = "\n".join(
        f"{ctx[-30:]!r:34} {cont!r:18} {n} tok  ll {ll:10.6f}  mesh - llama-cpp-python {d:+.2e}" for ctx, cont, n, ll, d in rows
    )
    print(f"\n{report}\nmax |difference| {max(abs(r[4]) for r in rows):.2e}, acc {correct}/{len(ITEMS)}")


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()
