"""The sink-probe measurements (analysis/sink_probe.py) on small converted models: the active/dormant split adds up to
the recorder's first-token mass, p and w agree where the variant does not rescale, the task metrics match a direct
computation, and the report on a Bigram-Backcopy compare run carries Table 4, the evolution figure and summary.json's
sink_probe. The slow test trains the sink-probe preset's softmax and checks that it forms the sink."""
from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from affine_attention.analysis import sink_probe  # noqa: E402
from affine_attention.analysis.capture import AttentionRecorder  # noqa: E402
from affine_attention.text.backcopy import task  # noqa: E402

TASK = dict(transitions="random", vocab=16, triggers=2, branching=3, seed=1)


def _model(variant: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    import affine_attention

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=64, vocab_size=17))
    affine_attention.convert(model, variant)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "alpha_proj" in name:
                p.normal_(0, 0.5)
            if name.endswith("sinks"):
                p.fill_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("alpha_ma"):
                b.fill_(0.3)
    return model.eval()


@pytest.mark.parametrize("variant, first_query_w", [("softmax", 1.0), ("affine", 0.3), ("sink", None)])
def test_active_dormant_split_adds_up_to_the_recorders_first_token_mass(variant, first_query_w):
    t = task(**TASK)
    ids = t.sequences("validation", 0, range(6), 25)
    model = _model(variant)
    m = sink_probe.measure(model, ids, t)
    with AttentionRecorder(model) as rec:
        with torch.no_grad():
            model(input_ids=ids[:, :-1], use_cache=False)
    records = rec.results()
    active = t.trigger_mask(ids[:, :-1])
    n_act, B, T = int(active.sum()), ids.shape[0], ids.shape[1] - 1
    n_dorm = B * T - n_act - B
    assert n_act > 0 and m["active_fraction"] == pytest.approx(float(active[:, 1:].double().mean()))
    for L, r in zip(m["layers"], records):
        # Query 0 sees only BOS: its weight is alpha_ma for affine (alpha p + (alpha_ma - alpha) / 1), 1 for softmax,
        # and 1 - its sink share for the sink variant (recorded by the recorder as well).
        q0 = first_query_w if first_query_w is not None else None
        total = L["w_first"]["active"] * n_act + L["w_first"]["dormant"] * n_dorm
        if q0 is None:
            rest = r.layer_mean("first_token_mass") * B * T - total
            assert 0 < rest / B < 1  # the first query's own weight, between 0 and 1 with a sink
        else:
            assert (total + q0 * B) / (B * T) == pytest.approx(r.layer_mean("first_token_mass"), rel=1e-5)
        if variant == "softmax":
            assert L["p_first"] == pytest.approx(L["w_first"])
            assert "alpha" not in L and "sink_share" not in L
        if variant == "affine":
            assert L["p_first"]["dormant"] != pytest.approx(L["w_first"]["dormant"])
            a = L["alpha"]["dormant"]
            assert 0 <= a["q25"] <= a["median"] <= a["q75"] <= 1
        if variant == "sink":
            assert 0 < L["sink_share"]["dormant"] < 1 and L["w_first"]["dormant"] < L["p_first"]["dormant"]
        uniform = (1.0 / torch.arange(1, T + 1, dtype=torch.float64)).expand(B, T)[active].mean()
        assert L["uniform_first"]["active"] == pytest.approx(float(uniform))


def test_task_metrics_match_a_direct_computation():
    t = task(**TASK)
    ids = t.sequences("validation", 0, range(5), 21)
    model = _model("softmax")
    m = sink_probe.measure(model, ids, t)
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits
    active = t.trigger_mask(ids[:, :-1])
    dormant = ~active
    dormant[:, 0] = False
    acc = (logits.argmax(-1) == ids[:, 1:])[active].double().mean()
    ce = torch.nn.functional.cross_entropy(logits[dormant], ids[:, 1:][dormant])
    assert m["backcopy_accuracy"] == pytest.approx(float(acc)) and m["bigram_loss"] == pytest.approx(float(ce), 1e-5)
    h = -(torch.from_numpy(t.probs) * torch.log(torch.from_numpy(t.probs).clamp_min(1e-300))).sum(1)
    assert m["bigram_entropy"] == pytest.approx(float(h[ids[:, :-1][dormant]].mean()))
    assert 0 < m["layers"][0]["value_norm_ratio"] and m["max_residual_norm_ratio"] > 0


def test_sink_criterion_and_aggregate():
    layer = {"layer": 1, "p_first": {"dormant": 0.31, "active": 0.0}, "uniform_first": {"dormant": 0.1}}
    assert sink_probe.sink_formed({"layers": [{**layer, "p_first": {"dormant": 0.05}}, layer]})
    assert not sink_probe.sink_formed({"layers": [{**layer, "p_first": {"dormant": 0.29}}]})
    agg = sink_probe.aggregate([{"layers": [layer], "bigram_loss": 1.0},
                                {"layers": [{**layer, "p_first": {"dormant": 0.11, "active": 0.0}}],
                                 "bigram_loss": 3.0}])
    assert agg["bigram_loss"] == {"mean": 2.0, "std": pytest.approx(math.sqrt(2)), "values": [1.0, 3.0]}
    assert agg["L1.p_first.dormant"]["mean"] == pytest.approx(0.21)


def test_report_on_a_backcopy_compare_run(tmp_path):
    from affine_attention.analysis.report import write_report
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config

    cfg = load_config("sink-probe", ["compare.variants=['softmax', 'affine']", "train.steps=12",
                                     "train.checkpoint_every=6", "train.eval_every=0", "train.threads=1"])
    compare(cfg, tmp_path, seeds=2, log=lambda m: None)
    write_report(tmp_path, sequences=4)
    md = (tmp_path / "report.md").read_text()
    assert "Table 4. The sink mechanism, by query role" in md and "figures/sink_evolution.png" in md
    assert (tmp_path / "figures" / "sink_evolution.png").stat().st_size > 5000
    s = json.loads((tmp_path / "summary.json").read_text())
    probe = s["sink_probe"]
    assert set(probe["variants"]) == {"softmax", "affine"} and probe["factor"] == 3.0
    assert sorted(map(int, probe["variants"]["affine"]["evolution"])) == [6, 12]  # kept checkpoints and final
    vals = probe["variants"]["affine"]["mean"][f"L{probe['layer']}.alpha.dormant.mean"]["values"]
    assert len(vals) == 2 and all(0 <= v <= 1 for v in vals)
    # The claims' sink test is the probe's, and says so.
    assert s["claims"]["baseline_sink"] == probe["reference_sink"]
    assert "dormant (non-trigger) queries" in s["claims"]["sink_criterion"]
    # The dormant first-token claim pairs the probe's own numbers (effective weights at the probe layer) by seed.
    row = next(r for r in s["claims"]["methods"]["affine"]["rows"] if r["claim"] == "first_token_dormant")
    w = {v: probe["variants"][v]["mean"][f"L{probe['layer']}.w_first.dormant"]["values"] for v in ("softmax", "affine")}
    diffs = [a - b for a, b in zip(w["affine"], w["softmax"])]
    assert row["baseline"]["diff"]["n"] == 2 and row["baseline"]["diff"]["mean"] == pytest.approx(sum(diffs) / 2)
    key = f"L{probe['layer']}.p_first.dormant"
    assert f"| p→BOS dormant | {probe['variants']['softmax']['mean'][key]['mean']:.3f}" in md


@pytest.mark.slow
def test_the_sink_probe_preset_forms_a_sink_in_softmax(tmp_path):
    """The preset's claim: plain softmax parks its dormant queries on BOS in at least 2 of 3 seeds."""
    from affine_attention.analysis.analyze import load_model
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config
    from affine_attention.train.data_backcopy import task_of

    cfg = load_config("sink-probe", ["compare.variants=['softmax']", "train.checkpoint_every=0"])
    compare(cfg, tmp_path, seeds=3, log=lambda m: None)
    t = task_of(cfg.data.backcopy)
    ids = t.sequences("validation", 0, range(64), cfg.data.seq_len + 1)
    formed = [sink_probe.sink_formed(sink_probe.measure(load_model(str(tmp_path / "softmax" / f"seed{k}" / "final"))[0],
                                                        ids, t)) for k in range(3)]
    assert sum(formed) >= 2, formed
