"""Every plot function writes a readable PNG of sensible size; styles are fixed and deterministic."""
import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from affine_attention import variants  # noqa: E402
from affine_attention.analysis import plots, style  # noqa: E402

VARIANTS = ["softmax", "sink", "affine", "affine_frozen"]
rng = np.random.default_rng(0)


def check_png(path, min_px=300):
    assert path.exists() and path.stat().st_size > 5_000
    img = imread(path)
    assert img.shape[0] >= min_px and img.shape[1] >= min_px
    assert img[..., :3].std() > 0.01  # something was drawn


def curves(base=3.0):
    steps = np.arange(0, 2000, 10)
    return {v: (steps, base * np.exp(-steps / 500) + 2.5 + 0.02 * i + 0.03 * rng.standard_normal(steps.size))
            for i, v in enumerate(VARIANTS)}


def test_loss_curves(tmp_path):
    check_png(plots.plot_loss_curves(curves(), tmp_path / "loss.png", smooth=5))


def test_grad_norms(tmp_path):
    steps = np.arange(1000)
    data = {v: (steps, np.abs(1 + 0.1 * rng.standard_normal(1000)) + (steps % 97 == 0) * 5) for v in VARIANTS}
    check_png(plots.plot_grad_norms(data, tmp_path / "gn.png"))
    check_png(plots.plot_grad_norms(data, tmp_path / "gn1.png", window=None, log_y=False), min_px=250)


def test_qk_logit(tmp_path):
    check_png(plots.plot_qk_logit(curves(1.0), tmp_path / "qk.png"), min_px=250)


def test_per_layer(tmp_path):
    values = {v: torch.rand(12) for v in VARIANTS}  # tensors are accepted too
    check_png(plots.plot_per_layer(values, "first-token mass", "First-token attention per layer",
                                   tmp_path / "sub" / "first.png"), min_px=250)


def test_head_heatmaps(tmp_path):
    masses = {v: rng.random((12, 8)) for v in VARIANTS}
    check_png(plots.plot_head_heatmaps(masses, tmp_path / "heads.png"))
    check_png(plots.plot_head_heatmaps({"softmax": rng.random((4, 4)) * 5}, tmp_path / "h1.png", normalise=True),
              min_px=250)


def test_mass_histograms(tmp_path):
    totals = {"softmax": rng.beta(2, 8, 3000), "sink": rng.beta(2, 5, 3000), "affine": rng.normal(0.6, 0.2, 3000),
              "gated": np.array([])}
    check_png(plots.plot_mass_histograms(totals, tmp_path / "mass.png"))


def test_loss_difference_panel_and_grids_that_fit_the_report(tmp_path):
    """The right loss panel with a reference shows each other variant minus it on the steps both logged; a grid of
    every registered variant's panels is no wider than the report shows without shrinking its text below ~11 px."""
    from affine_attention.analysis.plots import _minus

    got = _minus({"softmax": (np.array([1.0, 2, 3]), np.array([1.0, 1, 1])),
                  "affine": (np.array([2.0, 3, 4]), np.array([0.5, 2, 9]))}, "softmax")
    assert list(got) == ["affine"] and got["affine"][0].tolist() == [2, 3] and got["affine"][1].tolist() == [-0.5, 1]
    check_png(plots.plot_loss_curves(curves(), tmp_path / "loss.png", reference="softmax"))
    with pytest.raises(ValueError, match="reference 'ssmax' is not one of the curves"):
        plots.plot_loss_curves(curves(), tmp_path / "x.png", reference="ssmax")
    totals = {v: rng.random(500) for v in variants.variant_names()}  # 9 panels: 3 columns
    img = imread(plots.plot_mass_histograms(totals, tmp_path / "grid.png"))
    # shown in the report's ~1,130 px column: at most 1.4x wider, so 10 pt text stays above ~14 px (1,997 px before)
    assert img.shape[1] <= 1600, img.shape


def test_attention_map(tmp_path):
    tri = np.tril(np.ones((30, 30))) / np.arange(1, 31)[:, None]
    signed = tri - 0.05 * np.tril(np.ones((30, 30)))  # affine rows go negative
    check_png(plots.plot_attention_map({"softmax": tri}, tmp_path / "map1.png"), min_px=250)
    check_png(plots.plot_attention_map({"softmax": tri, "affine": signed}, tmp_path / "map2.png"))


def test_alpha_histograms(tmp_path):
    alphas = {"sigmoid": rng.beta(5, 5, 5000), "linear_clip": np.clip(rng.normal(0.5, 0.3, 5000), 0, 1)}
    check_png(plots.plot_alpha_histograms(alphas, tmp_path / "alpha.png"), min_px=250)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="curves"):
        plots.plot_loss_curves({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="same shape"):
        plots.plot_loss_curves({"softmax": (np.arange(3), np.arange(4))}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="2-D"):
        plots.plot_head_heatmaps({"softmax": np.zeros(3)}, tmp_path / "x.png")


def test_no_pyplot_figures_left_open(tmp_path):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plots.plot_qk_logit(curves(), tmp_path / "qk.png")
    assert plt.get_fignums() == before


def test_styles_fixed_and_deterministic():
    names = variants.variant_names()
    colours = [style.color(n) for n in names]
    assert len(set(colours)) == len(names)  # one distinct colour each
    # colour-blind-safe sets only: Okabe-Ito, then Paul Tol's muted set (variants.base.palette_colour)
    from affine_attention.variants.base import _TOL_MUTED, OKABE_ITO

    assert all(c.upper() in {*OKABE_ITO.values(), *_TOL_MUTED} for c in colours)
    assert style.label("affine") == "Affine-scaled" and style.style_for("Off-By-One") == style.style_for("off_by_one")
    assert style.color("my_variant") == style.color("my_variant") and style.label("my_variant") == "my_variant"
