"""Per-block torch.compile with activation checkpointing (train/blocks.py): no graph break in a checkpointed block,
the running statistics (alpha_acc) and the token statistics (metrics.TokenStats) recorded once per forward, losses
and gradients equal to eager (slow: tracing); selective checkpointing recomputes only every k-th block; the
2-process trainer run (FSDP2, compiled and checkpointed) equals eager (slow)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from test_hf_common import perturb, tiny
from test_train_helpers import REPO, read_records, sets, tiny as tiny_run  # noqa: F401  (fixture)

from affine_attention.train.blocks import checkpoint_blocks, compile_blocks, decoder_layers
from affine_attention.train.metrics import TokenStats


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _run(model, ids):
    stats = TokenStats(model)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    accs = [m.alpha_acc.clone() for m in stats.mods]
    collected = stats.collect(type("Info", (), {"enabled": False, "device": torch.device("cpu"), "world": 1})())
    stats.remove()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, accs, collected


@pytest.mark.slow  # ~25 s of tracing on 2 cores
def test_compiled_checkpointed_blocks_have_no_graph_break_and_equal_eager():
    eager = tiny("llama", "affine", num_hidden_layers=2).train()
    perturb(eager)
    compiled = copy.deepcopy(eager)
    assert checkpoint_blocks(compiled, every=1) == [0, 1]
    compile_blocks(compiled, backend="aot_eager")  # dynamo + AOTAutograd as inductor sees them, no C++ build
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    want = _run(eager, ids)
    got = _run(compiled, ids)
    counters = torch._dynamo.utils.counters
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks were compiled, not skipped
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(got[2], want[2]):  # alpha_acc: accumulated once, not again when the backward recomputes
        assert int(a[-1]) == ids.numel() and (a - b).abs().max() <= 2 ** 32 * 1e-6
    assert got[3]["alpha_mean"] == pytest.approx(want[3]["alpha_mean"], abs=1e-6)
    assert got[3]["alpha_std"] == pytest.approx(want[3]["alpha_std"], abs=1e-5)


def test_selective_checkpointing_recomputes_every_kth_block_only():
    model = tiny("llama", "affine", num_hidden_layers=4).train()
    assert checkpoint_blocks(model, every=2) == [0, 2]
    calls = [0] * 4
    for i, layer in enumerate(decoder_layers(model)):  # inside the block: the checkpoint sits below its own hooks
        layer.mlp.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    model(input_ids=torch.randint(0, 128, (1, 6)), labels=torch.randint(0, 128, (1, 6))).loss.backward()
    assert calls == [2, 1, 2, 1]  # checkpointed blocks run again in the backward
    with pytest.raises(ValueError, match="every 0 blocks"):
        checkpoint_blocks(model, every=0)


@pytest.mark.slow
def test_two_process_fsdp_compiled_checkpointed_training_equals_eager(tiny_run, tmp_path, monkeypatch):
    from torchrun_helpers import torchrun

    common = tiny_run + ["train.steps=2", "train.global_batch=4", "train.micro_batch=1", "variant.name='affine'",
                         "train.parallel='fsdp'", "train.eval_every=2"]
    outs = {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=true", "train.activation_checkpointing=true"])):
        monkeypatch.setenv("TORCH_LOGS", "graph_breaks")
        out = torchrun(["-m", "affine_attention.cli", "train", *sets(common + extra), "--out", str(tmp_path / name)],
                       pythonpath=[str(REPO)])
        outs[name] = out.stdout + out.stderr
    assert "Graph break" not in outs["compiled"], outs["compiled"][-3000:]
    eager, compiled = (read_records(tmp_path / n / "metrics.jsonl") for n in ("eager", "compiled"))
    for a, b in zip(compiled, eager):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert a["alpha_mean"] == pytest.approx(b["alpha_mean"], abs=1e-5)
        assert a["alpha_ma"] == pytest.approx(b["alpha_ma"], abs=1e-6)
    assert json.loads((tmp_path / "compiled" / "result.json").read_text())["running_stats_max_rank_diff"] == 0.0
