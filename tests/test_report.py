"""write_report / `affine-attention report` on a synthetic compare run directory (metrics, summary, checkpoints)."""
import base64
import json
import math
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from affine_attention.analysis import gradstats  # noqa: E402
from affine_attention.analysis.report import write_report  # noqa: E402
from affine_attention.cli import main  # noqa: E402

VARIANTS = ["softmax", "affine", "affine_frozen"]
SEEDS, STEPS = 2, 60
ATTENTION_FIGURES = ["first_token_mass", "entropy", "head_mass", "mass_histogram", "attention_map_layer1",
                     "alpha_histogram"]
TRAINING_FIGURES = ["loss", "heldout_loss", "grad_norm", "qk_logit", "alpha_training"]


def _checkpoint(path, variant):
    from transformers import LlamaConfig, LlamaForCausalLM

    import affine_attention
    from affine_attention.text.corpus import default_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=4096))
    affine_attention.convert(model, variant)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("alpha_ma"):
                b.fill_(0.5)
        for name, p in model.named_parameters():
            if "alpha_proj" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    default_tokenizer().save_pretrained(path)


@pytest.fixture(scope="module")
def run_dir():
    """A compare-layout run: summary.json, config.json, <variant>/seed<k>/{metrics.jsonl, result.json, final/}."""
    from affine_attention.train.config import RunConfig

    root = tempfile.mkdtemp(prefix="aa-report-")
    from pathlib import Path

    root = Path(root) / "run"
    cfg = RunConfig()
    cfg.compare.variants, cfg.compare.seeds, cfg.train.steps, cfg.data.seq_len = VARIANTS, SEEDS, STEPS, 32
    cfg = cfg.to_dict()
    rng = np.random.default_rng(0)
    params = {"softmax": 500_000, "affine": 500_512, "affine_frozen": 500_000}
    results = {}
    for i, v in enumerate(VARIANTS):
        results[v] = []
        for k in range(SEEDS):
            d = root / v / f"seed{k}"
            d.mkdir(parents=True)
            lines = [{"kind": "config", "config": cfg, "variant": v, "params": params[v]}]
            lines.append({"kind": "eval", "step": 0, "heldout_loss": 8.3, "heldout_ppl": math.exp(8.3),
                          "qk_logit_mean": 0.0})
            for s in range(1, STEPS + 1):
                norm = 1.0 + 0.1 * rng.standard_normal() + (5.0 if s in (7, 30 + i) else 0.0)
                rec = {"kind": "train", "step": s, "loss": 8 * math.exp(-s / 20) + 3 + 0.01 * i + 0.01 * k,
                       "ce_loss": 3.0, "lr": 1e-3, "grad_norm": norm, "tokens_per_s": 1000.0}
                if v.startswith("affine"):
                    rec.update(alpha_mean=[0.5 + 0.001 * s, 0.5], alpha_std=[0.1, 0.1], alpha_ma=[0.5, 0.5])
                lines.append(rec)
                if s % 20 == 0:
                    lines.append({"kind": "eval", "step": s, "heldout_loss": 4 - s / 60 + 0.02 * i + 0.005 * k,
                                  "heldout_ppl": math.exp(4 - s / 60), "qk_logit_mean": 0.01 * s * (1 + i)})
            result = {"variant": v, "params": params[v], "steps": STEPS, "final_train_loss": 3.1 + 0.01 * i + 0.01 * k,
                      "heldout_loss": 3.0 + 0.02 * i + 0.005 * k, "heldout_ppl": math.exp(3.0 + 0.02 * i),
                      "tokens_per_s": 1000.0, "wall_time_s": 10.0}
            lines.append({"kind": "end", "step": STEPS, **result})
            (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            (d / "result.json").write_text(json.dumps(result))
            results[v].append(result)
        _checkpoint(root / v / "seed0" / "final", v)
    summary = {"variants": {v: {"seeds": SEEDS, "params": params[v], "param_overhead": params[v] - 500_000}
                            for v in VARIANTS}, "seeds": SEEDS, "total_wall_time_s": 60.0, "config": cfg}
    (root / "summary.json").write_text(json.dumps(summary))
    write_report(root, sequences=2, length=40)
    yield root
    shutil.rmtree(root.parent, ignore_errors=True)


def test_markdown_has_tables_figures_and_controls(run_dir):
    md = (run_dir / "report.md").read_text()
    for title in ("Table 1.", "Table 2. Gradient-norm statistics", "Table 3. Methods against their controls",
                  "What this run shows and does not show", "hardware", "versions"):
        assert title in md, title
    for v in VARIANTS:
        assert f"| {v} |" in md
    assert "| affine_frozen | control |" in md and "| affine | method | 512 |" in md
    assert "| affine − affine_frozen | 2 |" in md
    assert "all 60 logged steps (1-60; the run is shorter than 500)" in md
    linked = re.findall(r"!\[[^\]]*\]\((figures/[^)]+\.png)\)", md)
    assert sorted(linked) == sorted(f"figures/{f}.png" for f in TRAINING_FIGURES + ATTENTION_FIGURES)
    for rel in linked:
        assert (run_dir / rel).stat().st_size > 5000
    captions = re.findall(r"\)\n\n\*([^*]+)\*", md)
    assert len(captions) == len(linked)


def test_gradient_table_matches_gradstats(run_dir):
    md = (run_dir / "report.md").read_text()
    per = [gradstats.stats_from_file(run_dir / "affine" / f"seed{k}" / "metrics.jsonl", window=(0, 61))
           for k in range(SEEDS)]
    cv = np.array([p["cv"] for p in per])
    row = next(line for line in md.splitlines() if line.startswith("| affine |") and "±" in line
               and line.count("|") == 8)
    assert f"{cv.mean():.3f} ± {cv.std(ddof=1):.3f}" in row
    assert all(p["spikes"][9] == 2 for p in per)  # the two injected spikes, k = 9
    assert row.endswith("| 2.0 ± 0.0 | 2.0 ± 0.0 |")


def test_html_is_self_contained(run_dir):
    html = (run_dir / "report.html").read_text()
    imgs = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(imgs) == len(TRAINING_FIGURES) + len(ATTENTION_FIGURES)
    assert all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in imgs)
    assert "figures/" not in html and "http" not in html.replace("http-equiv", "")
    # set-up, Table 1, gradient statistics, controls, Claims
    assert html.count("<table") == 5 and html.count("<figcaption") == len(imgs)


def test_report_cli_regenerates_without_checkpoints(run_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("final", "figures", "report.*"))
    assert main(["report", str(copy), "--no-attention", "--window", "30"]) == 0
    md = (copy / "report.md").read_text()
    assert "steps 1-30" in md and "first_token_mass" not in md
    said = capsys.readouterr()
    assert str(copy / "report.html") in said.out
    # The Claims verdicts close the output, each with its mark; each phase of the report says it ran.
    assert "Claims (verdicts" in said.out and re.search(r"affine vs softmax: .*: [✓✗≈–] ", said.out), said.out
    assert "report: training figures: done in" in said.err
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return exe


def _chromium_cmd(exe, tmp_path, *args):
    return [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'prof'}",
            *args]


def test_html_renders_in_headless_chromium(run_dir, tmp_path):
    exe = _chromium()
    shot = tmp_path / "shot.png"
    cmd = _chromium_cmd(exe, tmp_path, f"--screenshot={shot}", "--window-size=1280,3000",
                        (run_dir / "report.html").as_uri())
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    from matplotlib.image import imread

    img = imread(shot)[..., :3]
    assert img.shape[:2] == (3000, 1280)
    assert img.std() > 0.05 and (img < 0.5).mean() > 0.01  # text, tables and figures, not a blank page


# Laid out by the browser itself: for every table, how wide its content is against the box the page gives it, and
# where each column's header ends; the Claims verdict cells' text as rendered.
_LAYOUT_PROBE = """<script>
const out = [];
for (const t of document.querySelectorAll("table")) {
  const title = t.previousElementSibling && t.previousElementSibling.classList.contains("table-title")
    ? t.previousElementSibling.innerText : "";
  const heads = [...t.querySelectorAll("thead th")];
  out.push({title, scroll: t.scrollWidth, client: t.clientWidth, right: t.getBoundingClientRect().right,
            heads: heads.map(h => [h.innerText, h.getBoundingClientRect().right]),
            verdicts: heads.map((h, i) => h.innerText === "verdict" ? i : -1).filter(i => i >= 0)
              .flatMap(i => [...t.querySelectorAll("tbody tr")].map(r => r.children[i].innerText))});
}
const pre = document.createElement("pre"); pre.id = "layout"; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def test_claims_verdicts_fit_a_1280px_window_in_chromium(run_dir, tmp_path):
    """At 1280 px every column of every table, the Claims verdicts included, lies inside the window without
    scrolling, and a verdict cell holds the verdict word(s) and at most a note marker; the reasons are notes."""
    import html as html_mod
    import json as json_mod

    exe = _chromium()
    page = tmp_path / "report.html"
    page.write_text((run_dir / "report.html").read_text().replace("</body>", _LAYOUT_PROBE + "</body>"))
    dom = subprocess.run(_chromium_cmd(exe, tmp_path, "--window-size=1280,2000", "--dump-dom", page.as_uri()),
                         check=True, capture_output=True, timeout=120, text=True).stdout
    layout = json_mod.loads(html_mod.unescape(re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S).group(1)))
    claims = [t for t in layout if "claims" in t["title"].lower()]
    assert claims, [t["title"] for t in layout]
    for t in layout:
        assert t["scroll"] <= t["client"] + 1, (t["title"], t["scroll"], t["client"])  # nothing scrolled away
        assert t["right"] <= 1280, t["title"]
        assert all(right <= t["right"] + 1 for _, right in t["heads"]), (t["title"], t["heads"])
    for t in claims:
        # each verdict with its mark, read at a glance in a wide table
        assert t["verdicts"] and all(re.fullmatch(r"(✓ holds|✗ does not hold|≈ within seed spread|○ negligible|"
                                                  r"– not testable here)( \[\d+\])?", v) for v in t["verdicts"]), \
            t["verdicts"]
    # This fixture's softmax forms no sink, so the first-token row is not testable, and says why in a note.
    assert any(v.startswith("– not testable here [") for t in claims for v in t["verdicts"])
    assert '<ol class="notes"><li>softmax forms no attention sink' in (run_dir / "report.html").read_text()


def test_the_report_opens_with_the_summary_of_the_papers_claims(run_dir):
    """The answer first: after the title, the Summary (the paper's method's claims in words, then its table with
    effect, spread, n and verdicts); the evidence (Set-up, Tables 1-3) after it; affine is not repeated in Claims."""
    md = (run_dir / "report.md").read_text()
    heads = re.findall(r"^## (.+)$", md, re.M)
    assert heads[:3] == ["Summary", "Set-up", "Results"], heads
    summary = md[md.index("## Summary"):md.index("## Set-up")]
    claims = json.loads((run_dir / "summary.json").read_text())["claims"]
    rows = claims["methods"]["affine"]["rows"]
    assert "**Summary. The paper's claims for affine" in summary
    from affine_attention.analysis.claims import marked

    for r in rows:  # every claim's row, with the effect as summary.json records it and its verdict
        d, v = r["baseline"]["diff"], marked(r["baseline"]["verdict"])
        effect = f"{d['mean']:+.3g}" + (f" ± {d['std']:.3g}" if d["std"] is not None else "") + f" (n={d['n']})"
        assert re.search(rf"\| {re.escape(r['text'])} \| {r['metric']} \| [^|]+ \| {re.escape(effect)} \| "
                         rf"{re.escape(v)}( \[\d\])? \|", summary), (r, summary)
    said = summary.split("\n\n")[1:3]  # the verdicts in words, against the baseline and then the control
    assert said[0].startswith("affine against softmax (2 paired seeds): ✗ does not hold: lower training loss, ")
    assert said[1].startswith("affine against affine_frozen (2 paired seeds): ✓ holds: lower training loss, ")
    assert "The paper's claims for affine, against" not in md  # shown once, in the Summary


def test_table_3_reads_the_claims_numbers_and_verdicts(run_dir):
    """Table 3's row affine − affine_frozen gives, for each loss, the Claims row's paired mean ± std and verdict."""
    md = (run_dir / "report.md").read_text()
    claims = json.loads((run_dir / "summary.json").read_text())["claims"]
    from affine_attention.analysis.claims import marked

    rows = {r["claim"]: r["control"] for r in claims["methods"]["affine"]["rows"]}
    assert claims["methods"]["affine"]["control"] == "affine_frozen"
    line = next(x for x in md.splitlines() if x.startswith("| affine − affine_frozen |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    for key, (num, verdict) in (("heldout", (2, 3)), ("train_loss", (4, 5))):
        d = rows[key]["diff"]
        assert cells[num] == f"{d['mean']:+.4f} ± {d['std']:.4f}", (key, cells)
        assert cells[verdict] == marked(rows[key]["verdict"]), (key, cells, rows[key])


def test_every_verdict_in_summary_json_follows_the_rule(run_dir):
    from test_claims import _check_verdicts

    claims = json.loads((run_dir / "summary.json").read_text())["claims"]
    assert _check_verdicts(claims) == 8  # losses and gradients x 2 references (attention: one seed)


def test_gradient_figure_has_one_panel_when_the_window_is_the_whole_run(run_dir):
    """The 60-step run is shorter than the 500-step window: a second panel would repeat the first."""
    from matplotlib.image import imread

    grad, loss = imread(run_dir / "figures" / "grad_norm.png"), imread(run_dir / "figures" / "loss.png")
    assert grad.shape[1] < 0.65 * loss.shape[1], (grad.shape, loss.shape)
    md = (run_dir / "report.md").read_text()
    assert "first seed (not averaged: averaging hides spikes); all 60 logged steps" in md


def test_a_claims_table_with_long_names_fits_1280px_in_chromium(tmp_path):
    """affine_gated against scaled_softmax, the default run's longest pair: the long header wraps with its column,
    so the verdicts stay in view (a header that did not wrap pushed the last verdict column out of the window)."""
    import html as html_mod

    from affine_attention.analysis.claims import claim_rows
    from affine_attention.analysis.report_claims import claims_table
    from affine_attention.analysis.report_template import to_html

    exe = _chromium()
    metrics = ["final_train_loss", "heldout_loss", "grad_cv", "spikes_k9", "first_token_mass",
               "dormant_first_token_mass", "entropy", "head_mass_cv"]
    per_seed = {v: {s: {m: 1.0 + 0.1 * i + 0.001 * s + 0.0001 * k for k, m in enumerate(metrics)} for s in range(3)}
                for i, v in enumerate(["softmax", "affine_gated", "scaled_softmax"])}
    rows = claim_rows(per_seed, method="affine_gated", baseline="softmax", control="scaled_softmax",
                      baseline_sink=True, untestable={"heads": "one head per layer"})
    data = {"rule": "the rule", "baseline": "softmax", "methods": {"affine_gated": {"control": "scaled_softmax",
                                                                                     "rows": rows}}}
    page = tmp_path / "claims.html"
    page.write_text(to_html([claims_table(data, "affine_gated")], "claims").replace("</body>",
                                                                                    _LAYOUT_PROBE + "</body>"))
    dom = subprocess.run(_chromium_cmd(exe, tmp_path, "--window-size=1280,2000", "--dump-dom", page.as_uri()),
                         check=True, capture_output=True, timeout=120, text=True).stdout
    (t,) = json.loads(html_mod.unescape(re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S).group(1)))
    assert t["scroll"] <= t["client"] + 1 and t["right"] <= 1280, t
    assert [h for h, _ in t["heads"]][-2].replace("\n", " ") == "affine_gated − scaled_softmax"
    assert len(t["verdicts"]) == 16 and all(v.split(" [")[0] in ("○ negligible", "≈ within seed spread", "✓ holds",
                                                                 "✗ does not hold", "– not testable here")
                                            for v in t["verdicts"]), t["verdicts"]
