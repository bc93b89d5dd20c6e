"""End to end: the README's main command (`affine-attention compare`, tiny preset, offline) trains softmax, sink and
affine and writes the summary and the report with both tables and every figure."""
import json
import re
import time

import pytest

from affine_attention.cli import main


@pytest.mark.slow
def test_default_compare_writes_summary_and_report(tmp_path):
    t0 = time.time()
    assert main(["compare", "--out", str(tmp_path)]) == 0
    wall = time.time() - t0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["variants"]) == ["softmax", "sink", "affine"]
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
    print(f"default compare with report: {wall:.0f} s")  # timing is reported, never asserted
