"""Property tests (issue 33, item 6): random shapes, strides, dtypes, masks and non-finite placements, every backend
forced in turn and the automatic choice, against the float64 reference, on outputs and every gradient.

A seeded generator kept here (no new dependency): example `seed` is fully determined by its number, so a failure
names the seed that reproduces it (`python -m pytest tests/test_properties.py -k "seed_17"`). The default suite
runs DEFAULT examples; `-m slow` runs SLOW more.
"""
from __future__ import annotations

import random

import pytest
import torch

from affine_attention.ops import (
    affine_scaled_attention, affine_scaled_attention_reference, sink_attention, sink_attention_reference,
    softmax_attention, softmax_attention_reference,
)
from affine_attention.ops.backends import backend_names
from affine_attention.ops.reference import visible_mask

DEFAULT, SLOW = 60, 1500
BACKENDS = [None] + [n for n in backend_names() if n != "cuda_flash"]
LAYOUTS = ("contiguous", "transposed", "expanded", "offset")
NONFINITE = ("none", "none", "none", "q", "alpha", "k", "v")


def _present(leaf: torch.Tensor, layout: str) -> torch.Tensor:
    """leaf: (B, H, L, D) contiguous -> the same values in another memory layout, differentiably (so the gradient
    lands on the leaf). "expanded" reads head 0 over every head (stride 0): its leaf holds equal heads."""
    if layout == "transposed":  # stored (B, H, D, L): D not stride 1
        return leaf.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "expanded":
        return leaf[:, :1].expand(leaf.shape)
    if layout == "offset":  # a storage offset and a row stride larger than D
        return torch.nn.functional.pad(leaf, (2, 1, 1, 1))[:, :, 1:-1, 2:-1]
    return leaf


def _leaf_grad(gw: torch.Tensor, layout: str) -> torch.Tensor:
    """The reference's gradient on the values, as the gradient on a leaf presented by `_present`."""
    if layout != "expanded":
        return gw
    out = torch.zeros_like(gw)
    out[:, :1] = gw.sum(1, keepdim=True)
    return out


def example(seed: int) -> dict:
    """One random call: shapes, dtype, layouts, mask keywords, op and where a non-finite value goes."""
    rnd = random.Random(seed)
    B, Hkv = rnd.randint(1, 2), rnd.choice([1, 2])
    Hq = Hkv * rnd.choice([1, 2])
    S = rnd.randint(1, 13)
    T = rnd.choice([S, 1, rnd.randint(1, S)])
    D = rnd.choice([1, 3, 8])
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
               for H, L in ((Hq, T), (Hkv, S), (Hkv, S)))
    layouts = {n: rnd.choice(LAYOUTS) for n in "qkv"}
    q, k, v = (x[:, :1].expand(x.shape).contiguous() if layouts[n] == "expanded" else x
               for n, x in zip("qkv", (q, k, v)))
    mask: dict = {}
    kinds = rnd.choice([(), ("causal",), ("causal", "padding"), ("causal", "window"), ("causal", "padding", "window"),
                        ("documents",), ("causal", "documents"), ("dense",), ("padding",)])
    if "causal" in kinds:
        mask["is_causal"] = True
    if "padding" in kinds:
        km = torch.ones(B, 1, 1, S, dtype=torch.bool)
        km[0, ..., :rnd.randint(0, S - 1)] = False
        mask["attn_mask"] = km
    if "window" in kinds:
        mask["window"] = rnd.randint(1, S)
    if "documents" in kinds:
        cuts = sorted(rnd.sample(range(1, S), min(S - 1, rnd.randint(0, 2)))) if S > 1 else []
        ids = torch.zeros(S, dtype=torch.long)
        for c in cuts:
            ids[c:] += 1
        mask["document_ids"] = ids.expand(B, S).contiguous()
    if "dense" in kinds:
        mask["attn_mask"] = torch.rand(B, 1, T, S, generator=g) > 0.4
    if rnd.random() < 0.15:
        mask["softcap"] = rnd.choice([2.0, 20.0])
    return dict(seed=seed, layouts=layouts, q=q, k=k, v=v, mask=mask, dtype=rnd.choice([torch.float32, torch.float64]),
                op=rnd.choice(["softmax", "sink", "affine"]), nonfinite=rnd.choice(NONFINITE),
                alpha=torch.rand(B, Hq, T, generator=g, dtype=torch.float64),
                alpha_ma=torch.rand(Hq, generator=g, dtype=torch.float64),
                sinks=torch.randn(Hq, generator=g, dtype=torch.float64) * 2, gqa=Hq != Hkv, rnd=rnd)


def _call(ex, q, k, v, alpha, sinks, backend=None, reference=False):
    kw = dict(ex["mask"], enable_gqa=ex["gqa"])
    if ex["op"] == "softmax":
        return softmax_attention_reference(q, k, v, **kw)[0] if reference else softmax_attention(
            q, k, v, backend=backend, **kw)
    if ex["op"] == "sink":
        return sink_attention_reference(q, k, v, sinks, **kw)[0] if reference else sink_attention(
            q, k, v, sinks, backend=backend, **kw)
    am = ex["alpha_ma"].to(q.dtype)
    return affine_scaled_attention_reference(q, k, v, alpha, am, **kw)[0] if reference else \
        affine_scaled_attention(q, k, v, alpha, am, backend=backend, **kw)


def _poison(ex) -> tuple[dict, torch.Tensor | None]:
    """Place the example's non-finite value. Returns the inputs and, for a key or value row, the (B, Hq, T) queries
    the rule makes nan (those that may see the row); q and alpha the reference poisons by itself."""
    x = {n: ex[n].clone() for n in ("q", "k", "v", "alpha", "sinks")}
    where, rnd = ex["nonfinite"], ex["rnd"]
    val = rnd.choice([float("nan"), float("inf"), -float("inf")])
    B, Hq, T, _ = x["q"].shape
    Hkv, S = x["k"].shape[1], x["k"].shape[2]
    if where == "alpha":
        x["alpha"][rnd.randrange(B), rnd.randrange(Hq), rnd.randrange(T)] = val
        return x, None
    if where == "q":  # an expanded q shows head 0 everywhere: the value goes into every head
        h = slice(None) if ex["layouts"]["q"] == "expanded" else rnd.randrange(Hq)
        x["q"][rnd.randrange(B), h, rnd.randrange(T), rnd.randrange(x["q"].shape[3])] = val
        return x, None
    if where == "none":
        return x, None
    b, h, j = rnd.randrange(B), rnd.randrange(Hkv), rnd.randrange(S)
    name = where
    heads = range(Hkv) if ex["layouts"][name] == "expanded" else [h]  # an expanded tensor shows head 0 everywhere
    for h in heads:
        x[name][b, h, j, 0] = val
    m = ex["mask"]
    vis = visible_mask(m.get("attn_mask"), m.get("is_causal", False), T, S, "cpu", window=m.get("window"),
                       document_ids=m.get("document_ids")).expand(B, Hq, T, S)
    G = Hq // Hkv
    hit = torch.zeros(B, Hq, T, dtype=torch.bool)
    for h in heads:
        hit[b, h * G:(h + 1) * G] = vis[b, h * G:(h + 1) * G, :, j]
    return x, hit


def check(ex) -> None:
    x, hit = _poison(ex)
    ref_in = dict(x)
    if hit is not None:  # the reference multiplies hidden values by 0: clean the row, then apply the rule
        for n in ("k", "v"):
            ref_in[n] = torch.where(torch.isfinite(x[n]), x[n], torch.zeros((), dtype=x[n].dtype))
    leaves = {n: ref_in[n].detach().requires_grad_() for n in ("q", "k", "v", "alpha", "sinks")}
    want = _call(ex, leaves["q"], leaves["k"], leaves["v"], leaves["alpha"], leaves["sinks"], reference=True)
    finite_case = ex["nonfinite"] == "none"
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(ex["seed"]), dtype=torch.float64)
    names = ("q", "k", "v") + {"softmax": (), "sink": ("sinks",), "affine": ("alpha",)}[ex["op"]]
    grads_want = torch.autograd.grad(want, [leaves[n] for n in names], g, allow_unused=True) if finite_case else None
    want = want.detach()
    if hit is not None:
        want = want.masked_fill(hit[..., None], float("nan"))
    dt = ex["dtype"]
    tol = dict(atol=2e-4, rtol=2e-4) if dt == torch.float32 else dict(atol=1e-9, rtol=1e-7)
    for backend in BACKENDS:
        ins = {n: x[n].to(dt).requires_grad_() for n in x}
        shown = {n: _present(ins[n], ex["layouts"][n]) if n in "qkv" else ins[n] for n in ins}
        try:
            got = _call(ex, shown["q"], shown["k"], shown["v"], shown["alpha"], shown["sinks"], backend=backend)
        except ValueError as e:
            assert backend is not None, f"seed {ex['seed']}: the automatic choice refused: {e}"
            continue  # a forced backend that cannot serve this call says so
        where = (f"seed {ex['seed']} {ex['op']} on {backend} {dt} mask {sorted(ex['mask'])} layouts {ex['layouts']} "
                 f"nonfinite {ex['nonfinite']}")
        assert torch.equal(got.isnan(), want.isnan()), f"{where}: nan where the reference has none or vice versa"
        fin = ~want.isnan()
        torch.testing.assert_close(got[fin].double(), want[fin], **tol, msg=lambda m: f"{where}: {m}")
        if finite_case:
            grads = torch.autograd.grad(got, [ins[n] for n in names], g.to(dt), allow_unused=True)
            for n, gg, gw in zip(names, grads, grads_want):
                gw = torch.zeros_like(ins[n], dtype=torch.float64) if gw is None else gw
                gw = _leaf_grad(gw, ex["layouts"][n]) if n in "qkv" else gw
                gg = torch.zeros_like(ins[n]) if gg is None else gg
                torch.testing.assert_close(gg.double(), gw, **tol, msg=lambda m: f"{where} d{n}: {m}")


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed_{s}") for s in range(DEFAULT)])
def test_random_calls_match_the_reference_on_every_backend(seed):
    check(example(seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed_{s}") for s in range(DEFAULT, DEFAULT + SLOW)])
def test_random_calls_match_the_reference_on_every_backend_slow(seed):
    check(example(seed))
