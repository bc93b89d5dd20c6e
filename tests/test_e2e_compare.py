"""End to end: the README's main command (`affine-attention compare`, the sink-probe preset, offline) trains the
paper's variants and both controls with 3 seeds on the Bigram-Backcopy task and writes the summary and the report with its
tables, the Claims table (whose verdicts follow the stated rule from the numbers in summary.json), the sink-mechanism
table and every figure."""
import json
import os
import re
import subprocess
import sys
import time

import documented
import pytest


@pytest.mark.slow
def test_default_compare_writes_summary_and_report(tmp_path):
    # The README's command as written, in a fresh folder: it picks its own runs/compare-<time> folder there.
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.time()
    done = subprocess.run(["bash", "-c", documented.command("affine-attention compare")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    runs = list((tmp_path / "runs").glob("compare-*"))
    assert len(runs) == 1, runs
    tmp_path = runs[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    from affine_attention.train.config_load import load_config
    from affine_attention.variants import REGISTRY

    # the paper's variants and both controls (a variant added later, e.g. ssmax, joins with --set compare.variants)
    assert list(summary["variants"]) == load_config("sink-probe").compare.variants
    assert set(summary["variants"]) <= set(REGISTRY) and {"softmax", "affine", "scaled_softmax"} <= set(summary["variants"])
    assert all(v["seeds"] == 3 for v in summary["variants"].values())
    assert summary["hardware"] and "torch" in summary["versions"]
    for v in summary["variants"].values():
        assert v["heldout_ppl"]["mean"] > 1 and v["final_train_loss"]["mean"] > 0
    md = (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    assert "Δparams" in md or "overhead" in md.lower()
    assert re.search(r"CV", md) and re.search(r"k\s*=\s*6", md), "gradient-statistics table missing"
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    assert len(figures) >= 8, figures
    for f in figures:
        assert (tmp_path / f).is_file() and (tmp_path / f).stat().st_size > 5000, f
    assert html.count("data:image/png;base64,") == len(figures), "report.html must embed every figure"
    summary = json.loads((tmp_path / "summary.json").read_text())
    _check_claims(summary, md)
    probe = summary["sink_probe"]
    assert set(probe["variants"]) == set(summary["variants"]) and "Table 4. The sink mechanism" in md
    assert summary["claims"]["baseline_sink"] == probe["reference_sink"]
    print(f"default compare with report: {wall:.0f} s")  # timing is reported, never asserted


def _check_claims(summary: dict, md: str) -> None:
    """Every claim row has a verdict, and the verdict is the rule's on the numbers summary.json records (paired mean,
    sample std, n, the metric's minimum effect); the report opens with the paper's method's claims."""
    from test_claims import _check_verdicts

    from affine_attention.variants import REGISTRY

    claims = summary["claims"]
    assert md.index("## Summary") < md.index("## Set-up") and claims["rule"] in md
    rows = claims["methods"]["affine"]["rows"]
    assert claims["methods"]["affine"]["control"] == REGISTRY["affine"].controls[0]
    claimed = {r["claim"] for r in rows}
    assert {"train_loss", "heldout", "grad_cv", "spikes", "first_token", "entropy", "heads"} <= claimed
    for r in rows:
        for side in ("baseline", "control"):
            assert r[side]["diff"]["n"] == 3, (r["claim"], side, r[side])
            if r["claim"].startswith("first_token") and claims["baseline_sink"] is not True:
                assert r[side]["verdict"] == "not testable here"
            if r["claim"] == "heads":  # one head per layer in the sink-probe preset
                assert r[side]["verdict"] == "not testable here" and r[side]["why"].startswith("one head per layer")
    assert _check_verdicts(claims) >= 24
