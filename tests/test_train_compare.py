"""`compare` end to end on a tiny model: shared start per seed, the documented folder layout, summary contents;
the CLI entry points (train, compare, errors as one line)."""
from __future__ import annotations

import json

import torch

from affine_attention.train import loop
from affine_attention.train.compare import compare
from affine_attention.train.config_load import load_config
from test_train_helpers import read_records, tiny  # noqa: F401  (fixture)


def test_compare_layout_summary_and_shared_start(tiny, tmp_path, monkeypatch):
    calls = []
    real_train = loop.train

    def spy(cfg, out_dir, **kw):
        base = kw["base_model"]
        calls.append((kw["variant"], cfg.train.seed, id(base), {k: v.clone() for k, v in base.state_dict().items()}))
        return real_train(cfg, out_dir, **kw)

    monkeypatch.setattr(loop, "train", spy)
    cfg = load_config("tiny", tiny + ["train.steps=3", "compare.variants=['softmax', 'sink', 'affine']",
                                      "compare.options={affine = {activation = 'sigmoid'}}"])
    summary = compare(cfg, tmp_path / "cmp", seeds=2, log=lambda m: None)
    assert [(v, s) for v, s, _, _ in calls] == [(v, s) for s in (0, 1) for v in ("softmax", "sink", "affine")]
    for seed in (0, 1):
        same = [c for c in calls if c[1] == seed]
        assert len({c[2] for c in same}) == 1  # one base model per seed
        for _, _, _, sd in same[1:]:
            assert all(torch.equal(sd[k], same[0][3][k]) for k in sd)
    assert not torch.equal(calls[0][3]["model.embed_tokens.weight"], calls[3][3]["model.embed_tokens.weight"])

    root = tmp_path / "cmp"
    for name in ("summary.json", "summary.md", "config.json"):
        assert (root / name).is_file()
    for v in ("softmax", "sink", "affine"):
        for s in (0, 1):
            run = root / v / f"seed{s}"
            assert len(read_records(run / "metrics.jsonl")) == 3
            assert (run / "final" / "model.safetensors").is_file() and (run / "result.json").is_file()
    config = read_records(root / "affine" / "seed0" / "metrics.jsonl", "config")[0]
    assert config["variant_options"] == {"activation": "sigmoid"}
    on_disk = json.loads((root / "summary.json").read_text())
    assert on_disk["variants"] == json.loads(json.dumps(summary["variants"]))
    v = on_disk["variants"]
    assert v["softmax"]["param_overhead"] == 0 and v["sink"]["param_overhead"] == 2 * 2  # heads x layers
    assert v["affine"]["param_overhead"] == 32 * 2 * 2  # hidden x heads x layers
    assert len(v["affine"]["heldout_loss"]["values"]) == 2 and v["affine"]["heldout_loss"]["std"] is not None
    md = (root / "summary.md").read_text()
    assert "| affine | 128 |" in md and "held-out ppl" in md and " ± " in md

    # --resume reuses finished runs instead of training them again.
    calls.clear()
    compare(cfg, root, seeds=2, resume=True, log=lambda m: None)
    assert calls == []


def test_cli_train_and_errors(tiny, tmp_path, capsys):
    from affine_attention.cli import main

    sets = [x for o in tiny + ["train.steps=2", "variant.name='softmax'"] for x in ("--set", o)]
    assert main(["train", *sets, "--out", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "run folder:" in out and "heldout_loss" in out
    assert (tmp_path / "t" / "final" / "tokenizer.json").is_file()
    assert main(["train", "--set", "train.nope=1"]) == 2
    assert "error: " in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2
    assert "--resume needs the run folder" in capsys.readouterr().err
