"""The Triton epilogue kernels (ops/epilogue_triton.py) without a GPU.

- Launch geometry: `launch_grid` as a pure function of (B, H, T, D), within CUDA's grid limits at extreme sizes.
- Numerics: the kernels under the interpreter (TRITON_INTERPRET=1, in a subprocess so the flag is set before triton
  is imported) against the eager reference, once with CUDA's grid limits and once with lowered limits that fold
  the blocks of queries over grid axes 1 and 2 on small tensors.
- In compiled graphs: torch.compile(fullgraph=True) through AOTAutograd sees the epilogue as the registered operators
  (`affine_attention::epilogue` and its registered backward), whose graphs launch the forward kernel forward and the
  backward kernel backward; on fake CUDA tensors (inference: the autograd engine needs a real GPU for CUDA tensors) and
  on meta tensors standing in for CUDA in training.
- Compilation: every specialisation the launchers produce, compiled to PTX and cubin for sm_90 (ptxas ships in the
  triton wheel), without register spills and with every pointer offset and product in 64 bits. The launchers run
  on meta tensors with the kernels swapped for recorders, so the specialisations come from the launchers' own code.
  The default suite compiles a representative subset (48 kernels, 15-30 s); the full sweep (every constexpr flag
  combination x tile x dtype, D aligned to 16 and not: 3,184 kernels, 11-18 minutes on one CPU core) is marked
  slow: `pytest -m slow tests/test_triton_kernels.py -k sweep` (64 items, so pytest-xdist can spread it).

Skipped where triton is not installed.
"""
import contextlib
import io
import itertools
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton epilogue kernels need the `triton` package")

from affine_attention.ops import epilogue_triton as et  # noqa: E402  (after the skip)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_LIMITS = (2**31 - 1, 65535, 65535)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# Launch geometry: a pure function of the sizes.

def _check_geometry(B, H, T, D, elements, limits=CUDA_LIMITS):
    """launch_grid's answer covers every (pair, row) exactly once, within `limits`; returns it."""
    grid, block_t, block_d = et.launch_grid(B, H, T, D, elements, limits)
    assert len(grid) == 3 and all(1 <= n <= lim for n, lim in zip(grid, limits)), (grid, limits)
    # Tile: a power of two >= D wide, 1 to 64 rows, within the element budget unless one row alone exceeds it.
    assert block_d >= D and block_d & (block_d - 1) == 0 and block_d < 2 * D
    assert 1 <= block_t <= 64 and block_t & (block_t - 1) == 0
    assert block_t * block_d <= max(elements, block_d)
    # Axis 0: one program per pair. Axes 1 and 2: the N blocks of queries, block = y + Y * z, with fewer than Z
    # blocks past the last (the kernel masks their rows off, t >= T).
    pairs, Y, Z = grid
    assert pairs == B * H
    n = triton.cdiv(T, block_t)
    assert Y * Z >= n > Y * (Z - 1) and Y * Z - n < Z
    return grid, block_t, block_d


EXTREME = {
    "decode-b2048-h32": (2048, 32, 1, 128),  # 65,536 pairs: one past CUDA's y limit, where the old grid had them
    "decode-b4096-h64-d256": (4096, 64, 1, 256),
    "pairs-2^31-1": (2**31 - 1, 1, 1, 1),  # the most pairs launch_grid accepts
    "pairs-2^31-1-d256": (1, 2**31 - 1, 1, 256),
    "pairs-2^31": (2**16, 2**15, 1, 1),
    "t-1e7-d128": (1, 1, 10**7, 128),  # 625,000 blocks of queries at 16 rows: folded over axes 1 and 2
    "t-1e7-d1": (1, 1, 10**7, 1),
    "t-1e7-d256": (1, 1, 10**7, 256),
    "t-2^31-d256": (1, 1, 2**31, 256),
    "t-2^36-d256": (1, 1, 2**36, 256),
    "prefill-b64-h128-t32768": (64, 128, 32768, 128),
    "train-b8-h32-t1e6-d256": (8, 32, 10**6, 256),
    "tiny": (1, 1, 1, 1),
}


@pytest.mark.parametrize("elements", [et.FWD_ELEMENTS, et.BWD_ELEMENTS, et.BWD_ELEMENTS // 2], ids=str)
@pytest.mark.parametrize("sizes", EXTREME.values(), ids=EXTREME.keys())
def test_launch_grid_stays_within_cuda_limits_at_extreme_sizes(sizes, elements):
    B, H, T, D = sizes
    block_t = et.blocks(D, elements)[0]
    if B * H > CUDA_LIMITS[0] or triton.cdiv(T, block_t) > CUDA_LIMITS[1] * CUDA_LIMITS[2]:
        with pytest.raises(ValueError, match="exceeds the grid limits"):
            et.launch_grid(B, H, T, D, elements)
        return
    grid, _, _ = _check_geometry(B, H, T, D, elements)
    if triton.cdiv(T, block_t) <= CUDA_LIMITS[1]:
        assert grid[2] == 1  # folded only where it must be


def test_launch_grid_for_every_head_dim_and_the_fold_arithmetic():
    for D in range(1, 257):
        for elements in (et.FWD_ELEMENTS, et.BWD_ELEMENTS, et.BWD_ELEMENTS // 2):
            _check_geometry(3, 5, 37, D, elements)
            _check_geometry(1, 1, 10**7 + 1, D, elements)
    # Lowered limits (as the interpreter test uses): 3 blocks of 64 rows over y <= 2 fold into 2 slices of 2, one
    # block idle.
    assert et.launch_grid(2, 4, 150, 8, 4096, (2**31 - 1, 2, 65535)) == ((8, 2, 2), 64, 8)
    for T in range(1, 300):
        _check_geometry(2, 3, T, 8, 128, (2**31 - 1, 7, 65535))  # blocks of 16 rows
    with pytest.raises(ValueError, match="exceeds the grid limits"):
        et.launch_grid(1, 1, 50 * 16, 8, 128, (2**31 - 1, 7, 7))  # 50 blocks > 7 * 7
    with pytest.raises(ValueError, match="exceeds the grid limits"):
        et.launch_grid(1, 5, 65, 256, 4096, (4, 65535, 65535))  # 5 pairs > 4


class _Recorder:
    """Stands in for wrap_triton(kernel): records each launch (kernel, grid, arguments) instead of running it."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, grid, args, kwargs))


@contextlib.contextmanager
def _recorded_launches():
    """Within the block the launchers record their launches into the list yielded; nothing runs, so meta tensors
    (no storage, any size) serve as operands. The launchers launch through `wrap_triton`, swapped here."""
    launches = []
    saved = et.wrap_triton
    et.wrap_triton = lambda kernel: _Recorder(kernel, launches)
    try:
        yield launches
    finally:
        et.wrap_triton = saved


def _meta(*shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _operands(dtype, B, Hq, Hm, T, Tm, D, gate, affine=True, alpha_dtype=None):
    """Meta operands as the variants make them: out (B, Hq, T, D); alpha (B, Hq, T), a transposed (B, T, Hq)
    projection; alpha_ma (Hq,); m (B, Hm, Tm, D); gate None, "elementwise" (B, Hq, T, D), "headwise" (B, Hq, T, 1),
    "scale" (1, Hq, 1, 1) or "constant" (1, 1, 1, 1) in the accumulation dtype (gate4 of a float)."""
    ad = alpha_dtype or dtype
    out = _meta(B, Hq, T, D, dtype=dtype)
    alpha = _meta(B, T, Hq, dtype=ad).transpose(1, 2) if affine else None
    am = _meta(Hq, dtype=ad) if affine else None
    m = _meta(B, Hm, Tm, D, dtype=dtype) if affine else None
    shapes = {"elementwise": (B, Hq, T, D), "headwise": (B, Hq, T, 1), "scale": (1, Hq, 1, 1), "constant": (1,) * 4}
    g = None
    if gate is not None:
        g = _meta(*shapes[gate], dtype=torch.float32 if dtype != torch.float64 and gate == "constant" else ad)
    return out, alpha, am, m, g


def test_launchers_keep_the_sizes_of_the_issue_within_cuda_grid_limits():
    """Decoding with batch 2048 x 32 heads: 65,536 (batch, head) pairs, one more than CUDA allows on grid axis y,
    where the old launchers put them; and 10^7 queries of one head, whose blocks fold over axes 1 and 2."""
    with _recorded_launches() as launches:
        for B, Hq, Hm, T in ((2048, 32, 32, 1), (2048, 32, 8, 1), (1, 2, 1, 10**7)):
            out, alpha, am, m, g = _operands(torch.bfloat16, B, Hq, Hm, T, T, 128, "headwise")
            et.forward(out, alpha, am, m, g)
            et.backward(out, out, alpha, am, m, g, need_alpha=True, need_alpha_ma=True, need_gate=True, need_m=True)
    grids = [grid for _, grid, _, _ in launches]
    assert grids[:4] == [(65536, 1, 1), (65536, 1, 1), (65536, 1, 1), (16384, 1, 1)]
    for pairs, (_, grid, _, kwargs) in zip((2, 1), launches[4:]):  # T = 10^7 in blocks of 16 (8 backward) rows
        assert grid[0] == pairs and grid[1] <= 65535 < grid[1] * grid[2]
        assert grid[1] * grid[2] * kwargs["BLOCK_T"] >= 10**7
    assert all(n <= lim for grid in grids for n, lim in zip(grid, CUDA_LIMITS))


# ---------------------------------------------------------------------------------------------------------------
# Numerics under the interpreter.

TRITON_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from affine_attention.ops import epilogue_triton as et
    from affine_attention.ops.attention import attention_with_epilogue
    from affine_attention.ops.epilogue import epilogue
    torch.manual_seed(0)
    FOLD = sys.argv[1] == "fold"
    # Lowered grid limits: at most 2 programs on axis y, so a few blocks of queries fold over axes 1 and 2 on small
    # tensors, with programs idle past the last block (3 blocks -> 2 x 2).
    LIMITS = (2**31 - 1, 2, 65535) if FOLD else et.GRID_LIMITS
    grids = []  # (blocks of queries, grid) of every launch
    launch_grid = et.launch_grid
    def recording_grid(B, H, T, D, elements, limits):
        grid, block_t, block_d = launch_grid(B, H, T, D, elements, limits)
        grids.append(((T + block_t - 1) // block_t, grid))
        return grid, block_t, block_d
    et.launch_grid = recording_grid

    def triton_with(limits, f):
        saved, et.GRID_LIMITS = et.GRID_LIMITS, limits
        try:
            return f()
        finally:
            et.GRID_LIMITS = saved

    def compare(dtype, B, Hq, Hm, T, Tm, D, gate_shape, affine, tol):
        o = torch.randn(B, Hq, T, D, dtype=dtype, requires_grad=True)
        a = torch.rand(B, T, Hq).transpose(1, 2).to(dtype).requires_grad_() if affine else None
        am = torch.rand(Hq, dtype=dtype, requires_grad=True) if affine else None
        m = torch.randn(B, Hm, Tm, D, dtype=dtype, requires_grad=True) if affine else None
        g = torch.rand(*gate_shape, dtype=dtype, requires_grad=True) if gate_shape else None
        ins = [t for t in (o, a, am, m, g) if t is not None]
        w = torch.randn(B, Hq, T, D, dtype=dtype)
        def run(impl):
            y = epilogue(o, alpha=a, alpha_ma=am, v_mean=m, gate=g, impl=impl)
            return (y,) + torch.autograd.grad(y, ins, w)
        ref, res = run("eager"), triton_with(LIMITS, lambda: run("triton"))
        for x, z in zip(ref, res):
            assert x.dtype == z.dtype and x.shape == z.shape, (x.dtype, z.dtype, x.shape, z.shape)
            torch.testing.assert_close(x.double(), z.double(), rtol=tol, atol=tol)
        if FOLD:  # the fold changes which program computes a row, never how: bit for bit the unfolded result
            for x, z in zip(triton_with(et.GRID_LIMITS, lambda: run("triton")), res):
                assert torch.equal(x, z)

    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        compare(dtype, 2, 4, 2, 37, 37, 24, (2, 4, 37, 24), True, tol)   # GQA, elementwise gate, D not 2^k
        compare(dtype, 2, 4, 1, 5, 1, 16, (2, 4, 5, 1), True, tol)       # decoding mean (T = 1), headwise
        compare(dtype, 1, 4, 4, 1, 1, 8, (1, 4, 1, 1), True, tol)        # one query, per-head scale
        compare(dtype, 2, 3, 3, 70, 70, 8, None, True, tol)              # affine alone, several T blocks
        compare(dtype, 2, 4, 4, 9, 9, 8, (2, 4, 9, 8), False, tol)       # gated alone
    compare(torch.float64, 3, 6, 2, 7, 7, 5, (3, 6, 7, 5), True, 1e-12)  # GQA groups of 3
    # Several blocks of queries (64 rows at D = 8; 32 and 64 at D = 64): folded under the lowered limits.
    compare(torch.float64, 2, 4, 2, 150, 150, 8, (2, 4, 150, 8), True, 1e-12)
    compare(torch.float32, 1, 2, 1, 130, 1, 64, (1, 2, 130, 1), True, 1e-5)  # decoding-style mean, headwise
    compare(torch.bfloat16, 2, 2, 2, 200, 200, 64, (2, 2, 200, 64), False, 2e-2)
    # Through the op: the mean recomputed from V in backward, padding, T < S.
    q, k, v = (torch.randn(2, 4, t, 8, dtype=torch.float64, requires_grad=True) for t in (5, 12, 12))
    k, v = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    alpha = torch.rand(2, 4, 5, dtype=torch.float64, requires_grad=True)
    am = torch.rand(4, dtype=torch.float64)
    keys = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    keys[1, ..., :3] = False
    res = []
    for impl in ("eager", "triton"):
        y = triton_with(LIMITS, lambda: attention_with_epilogue(
            q, k, v, alpha=alpha, alpha_ma=am, attn_mask=keys, is_causal=True, enable_gqa=True,
            epilogue_impl=impl))
        res.append((y,) + torch.autograd.grad(y.square().sum(), (q, k, v, alpha)))
    for x, z in zip(*res):
        torch.testing.assert_close(x, z, rtol=1e-12, atol=1e-12)
    if FOLD:  # folded launches, some with idle programs past the last block, did run
        assert any(g[2] > 1 and g[1] * g[2] > n for n, g in grids), grids
    print("triton epilogue ok:", len(grids), "launches,", sum(g[2] > 1 for _, g in grids), "folded")
""")


@pytest.mark.parametrize("limits", ["cuda", "fold"])
def test_triton_kernels_match_eager_under_the_interpreter(limits):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, limits], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "triton epilogue ok" in r.stdout


NONFINITE_SCRIPT = textwrap.dedent("""
    import torch
    from affine_attention.ops import nonfinite
    from affine_attention.ops import nonfinite_triton as nt
    from affine_attention.ops.attention import attention_with_epilogue
    torch.manual_seed(0)
    nonfinite._asks = lambda t: False  # the rule's path where asking would sync: every row tested, as on CUDA
    NAN, INF = float("nan"), float("inf")

    def layout(x, transposed):
        # (B, H, S, D) values, stored as the projections make them when transposed: a (B, S, H, D) tensor's view.
        return x.transpose(1, 2).contiguous().transpose(1, 2) if transposed else x

    def check_isolate(dtype, B, H, S, D, transposed, keys, put):
        k, v = (torch.randn(B, H, S, D, dtype=torch.float64).to(dtype) for _ in range(2))
        for name, idx, value in put:
            (k if name == "k" else v)[idx] = value
        k, v = layout(k, transposed), layout(v, transposed)
        bad = ~(nonfinite._finite_rows(k) & nonfinite._finite_rows(v))
        row = bad[..., None] if keys is None else bad[..., None] | ~keys.reshape(keys.shape[0], 1, -1, 1)
        k0, v0, got = nt.OPS.isolate(k, v, keys)
        assert torch.equal(got, bad), (got, bad)
        assert torch.equal(nt.OPS.nonfinite_rows(k, v), bad)
        assert k0.dtype == dtype and torch.equal(k0, k.masked_fill(row, 0)) and torch.equal(v0, v.masked_fill(row, 0))
        # Backward: the gradient of every zeroed row is 0, of every other row what arrives, as masked_fill's.
        kg, vg = (t.detach().clone().requires_grad_() for t in (k, v))
        wk, wv = torch.randn_like(k0), torch.randn_like(v0)
        dk, dv = torch.autograd.grad(nt.OPS.isolate(kg, vg, keys)[:2], (kg, vg), (wk, wv))
        assert torch.equal(dk, wk.masked_fill(row, 0)) and torch.equal(dv, wv.masked_fill(row, 0))
        return int(bad.sum())

    def check_poison(dtype, B, Hq, Hs, T, Ts, D, transposed, alpha_on, put):
        q, out = (layout(torch.randn(B, Hq, T, D, dtype=torch.float64).to(dtype), transposed) for _ in range(2))
        alpha = torch.rand(B, T, Hq, dtype=dtype).transpose(1, 2) if alpha_on else None
        seen = torch.rand(B, Hs, Ts, 1) > 0.7
        for name, idx, value in put:
            {"q": q, "alpha": alpha}[name][idx] = value
        want = nonfinite.poison(out, seen, q, alpha)
        got = nt.OPS.poison(out, q, alpha, seen)
        assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan()), (got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        og = out.detach().clone().requires_grad_()
        w = torch.randn_like(out)
        d = torch.autograd.grad(nt.OPS.poison(og, q, alpha, seen), og, w)[0]
        assert torch.equal(d, w.masked_fill(want.isnan().any(-1, keepdim=True), 0))
        return int(want.isnan().any(-1).sum())

    found = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        keys = torch.ones(2, 1, 1, 37, dtype=torch.bool)
        keys[1, ..., 30:] = False
        keys[0, ..., :2] = False
        put = [("k", (0, 1, 5, 3), NAN), ("v", (1, 0, 36, 0), -INF), ("k", (1, 2, 0, 4), INF),
               ("k", (1, 1, 31), 3e38 if dtype != torch.float16 else 6e4), ("v", (0, 0, 0), -3e38 if dtype !=
               torch.float16 else -6e4)]  # padded rows near the dtype's range: zeroed though finite
        for transposed in (False, True):
            found += check_isolate(dtype, 2, 3, 37, 5, transposed, keys, put)   # odd D and S
            found += check_isolate(dtype, 2, 3, 37, 5, transposed, None, put)   # no padding
            found += check_isolate(dtype, 1, 2, 150, 8, transposed, keys[:1, ..., :1].expand(1, 1, 1, 150).clone(),
                                   [("v", (0, 1, 140, 7), NAN)])  # several blocks of key rows, one batch of keys
            qput = [("q", (0, 1, 3, 2), NAN), ("q", (1, 3, 0, 4), -INF), ("alpha", (1, 2, 6), INF),
                    ("alpha", (0, 0, 0), NAN)]
            found += check_poison(dtype, 2, 4, 2, 7, 7, 5, transposed, True, qput)    # GQA seen per KV head
            found += check_poison(dtype, 2, 4, 4, 7, 1, 5, transposed, False, qput[:2])  # seen per head, T|1
            found += check_poison(dtype, 1, 2, 1, 130, 130, 64, transposed, True, [("q", (0, 1, 129, 63), INF)])
    assert found > 0
    # Through the op, float64 and float32: the fused passes give what the torch passes give, outputs and gradients
    # bit for bit (softmax: no epilogue, whose Triton kernel rounds differently from the eager one).
    for dtype in (torch.float64, torch.float32):
        B, Hq, Hk, T, S, D = 2, 4, 2, 5, 7, 8
        base = [torch.randn(B, Hq, T, D, dtype=dtype), torch.randn(B, Hk, S, D, dtype=dtype),
                torch.randn(B, Hk, S, D, dtype=dtype)]
        base[1][1, 1, 3, 2], base[2][0, 0, 1, 0], base[0][0, 1, 2, 3] = NAN, INF, -INF
        base[1][1, 0, 6] = 3e38  # a padded key near float32's range
        keys = torch.tensor([True] * 5 + [False, False])[None, None, None].expand(B, 1, 1, S)
        for kw in ({}, dict(is_causal=True), dict(attn_mask=keys, is_causal=True), dict(is_causal=True, window=3)):
            res = []
            for fused in (False, True):
                nonfinite._fused = (lambda impl, f=nonfinite._fused: f("triton")) if fused else (lambda impl: None)
                x = [t.clone().requires_grad_() for t in base]
                y = attention_with_epilogue(*x, enable_gqa=True, **kw)
                y.nan_to_num(0.0).sum().backward()
                res.append([y] + [t.grad for t in x])
            for a, b in zip(*res):
                torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)
            assert res[1][0].isnan().any() and not res[1][0].isnan().all()
    print("triton non-finite ok:", found, "rows found")
""")


def test_fused_non_finite_passes_match_the_torch_passes_under_the_interpreter():
    """ops/nonfinite_triton.py against ops/nonfinite.py's torch passes: flags, copies, nan rows and gradients, bit for
    bit, for nan and inf in k, v, q and alpha, padded rows near the dtype's range, odd shapes, GQA, transposed
    (non-contiguous) layouts, every dtype."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", NONFINITE_SCRIPT], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "triton non-finite ok" in r.stdout


# ---------------------------------------------------------------------------------------------------------------
# In compiled graphs: the registered operators, forward and backward.

def _graphs_of(fn, *args):
    """{"dynamo", "forward", "backward"}: the graphs torch.compile(fullgraph=True) makes of fn(*args) through
    AOTAutograd (the graphs AOTAutograd hands a backend such as inductor), and fn's output; "backward" once the
    caller's backward ran."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compiler

    def backend(gm, example_inputs):
        graphs["dynamo"] = gm
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    torch._dynamo.reset()
    return graphs, torch.compile(fn, backend=backend, fullgraph=True)(*args)


def _launched(gm):
    """The Triton kernels (their JITFunctions) a graph launches, in order."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernels = []
    for node in gm.graph.nodes:
        if "triton_kernel_wrapper" in str(node.target):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            kernels.append(getattr(kernel, "fn", kernel))  # a launch with num_warps is a one-config Autotuner
    return kernels


def _called(gm):
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need torch's CUDA build")
def test_compiled_epilogue_on_cuda_is_the_registered_operator():
    """Fake CUDA tensors: the device picks the Triton epilogue, and the compiled graph holds the registered operator,
    whose AOT graph launches the forward kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from affine_attention.ops.epilogue import epilogue

    with FakeTensorMode():
        out, alpha, am, m, gate = (torch.empty(s, device="cuda", dtype=d) for s, d in (
            ((2, 4, 5, 64), torch.bfloat16), ((2, 4, 5), torch.float32), ((4,), torch.float32),
            ((2, 2, 5, 64), torch.bfloat16), ((2, 4, 5, 1), torch.bfloat16)))
        graphs, y = _graphs_of(lambda *a: epilogue(a[0], alpha=a[1], alpha_ma=a[2], v_mean=a[3], gate=a[4]),
                               out, alpha, am, m, gate)
    assert (y.shape, y.dtype, y.device.type) == ((2, 4, 5, 64), torch.bfloat16, "cuda")
    assert _called(graphs["dynamo"]) == [torch.ops.affine_attention.epilogue]
    assert _launched(graphs["forward"]) == [et._epilogue_fwd]


@pytest.fixture
def triton_on_meta(monkeypatch):
    """The epilogue picks its Triton implementation for meta tensors, standing in for CUDA ones (whose backward the
    autograd engine cannot run without a GPU: "hasPrimaryContext expects a valid device index")."""
    from affine_attention.ops import epilogue

    monkeypatch.setattr(epilogue, "select_impl", lambda device, impl=None: "triton")


def _meta_operands():
    """out (2, 4, 6, 64), v (2, 2, 6, 64) bf16; alpha (2, 4, 6), alpha_ma (4,) float32; gate (2, 4, 6, 64) bf16."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, device="meta", dtype=dtype, requires_grad=True)
    return t(2, 4, 6, 64), t(2, 2, 6, 64), t(2, 4, 6, dtype=torch.float32), t(4, dtype=torch.float32), t(2, 4, 6, 64)


# (name, the epilogue's call): the mean given (its registered backward), the mean of V recomputed in backward (the
# Function around the registered operators), a gate alone.
COMPILED_PATHS = {
    "v_mean": lambda o, v, a, am, g: _epilogue()(o, alpha=a, alpha_ma=am, v_mean=v, gate=g),
    "mean_of_v": lambda o, v, a, am, g: _epilogue()(o, alpha=a, alpha_ma=am, v=v, mask=_causal()),
    "gate": lambda o, v, a, am, g: _epilogue()(o, gate=g),
}


def _epilogue():
    from affine_attention.ops.epilogue import epilogue
    return epilogue


def _causal():
    from affine_attention.ops.masks import parse_mask
    return parse_mask(None, True, 2, 4, 6, 6, torch.device("meta"))


@pytest.mark.parametrize("path", COMPILED_PATHS)
def test_compiled_training_launches_the_registered_backward(path, triton_on_meta):
    """Training, fullgraph: the forward graph launches the forward kernel and the backward graph the backward kernel
    (a graph that differentiated the epilogue as zero, or around it, would not), every input gets its gradient."""
    out, v, alpha, am, gate = _meta_operands()
    graphs, y = _graphs_of(COMPILED_PATHS[path], out, v, alpha, am, gate)
    y.float().sum().backward()
    if path != "mean_of_v":  # the registered operator itself, not an autograd.Function around a launch
        assert _called(graphs["dynamo"]) == [torch.ops.affine_attention.epilogue]
    assert _launched(graphs["forward"]) == [et._epilogue_fwd]
    assert _launched(graphs["backward"]) == [et._epilogue_bwd]
    used = {"v_mean": (out, v, alpha, am, gate), "mean_of_v": (out, v, alpha, am), "gate": (out, gate)}[path]
    assert all(t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype for t in used)


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need torch's CUDA build")
@pytest.mark.parametrize("mask", ["padding", "none"])
def test_compiled_non_finite_rule_on_cuda_is_the_fused_operators(mask):
    """Fake CUDA tensors, fullgraph (no graph break): the rule enters the graph as the registered operators, each one
    fused kernel launch (k and v copied with their row flags, or the flags alone without a mask; the output masked
    with q's test), and none of the torch path's row reductions or masked copies."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from affine_attention.ops import nonfinite_triton as nt
    from affine_attention.ops import softmax_attention

    kw = dict(is_causal=True) if mask == "padding" else {}
    with FakeTensorMode():
        q = torch.empty(2, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.empty(2, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        keys = torch.empty(2, 1, 1, 16, device="cuda", dtype=torch.bool) if mask == "padding" else None
        graphs, y = _graphs_of(lambda q, k, v, m: softmax_attention(q, k, v, attn_mask=m, enable_gqa=True, **kw),
                               q, k, v, keys)
    assert (y.shape, y.dtype, y.device.type) == ((2, 4, 16, 64), torch.bfloat16, "cuda")
    called = _called(graphs["dynamo"])
    assert called.count(torch.ops.affine_attention.isolate_rows) == 1, called
    assert called.count(torch.ops.affine_attention.poison) == 1, called
    assert not {torch.aminmax, torch.Tensor.masked_fill} & set(called), called  # the torch path's passes
    launched = _launched(graphs["forward"])
    assert launched[0] is nt._isolate_kernel and launched[-1] is nt._poison_kernel, launched


def test_compiled_training_differentiates_the_fused_non_finite_operators():
    """Meta tensors standing in for CUDA in training, fullgraph: the forward graph launches both fused kernels, the
    backward graph holds their registered backward (the masked_fill of each zeroed or nan row: d k, d v, d out), and
    k, v and q get their gradients."""
    from affine_attention.ops import nonfinite, nonfinite_triton as nt

    def fn(q, k, v):
        k0, v0, seen = nonfinite.isolate(q, k, v, _causal(), 0.125, impl="triton")
        out = q + (k0 * v0).repeat_interleave(2, dim=1)
        return nonfinite.poison(out, seen, q, None, impl="triton")

    q = torch.empty(2, 4, 6, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(2, 2, 6, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    graphs, y = _graphs_of(fn, q, k, v)
    y.float().sum().backward()
    assert _launched(graphs["forward"]) == [nt._isolate_kernel, nt._poison_kernel]
    backward = _called(graphs["backward"])
    assert backward.count(torch.ops.aten.masked_fill.Scalar) == 3, backward
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


# ---------------------------------------------------------------------------------------------------------------
# Compilation for sm_90 without a GPU.

_TT_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
              torch.bool: "i1"}
_DIV16 = [["tt.divisibility", 16]]


_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _specialisation(kernel, args, kwargs):
    """(signature, constexprs, attrs, options) of a launch, by the rules Triton's launcher applies (runtime/jit.py,
    native_specialize_impl): a tensor is a typed pointer, 16-byte aligned (torch's allocator); an int equal to 1
    becomes the constexpr 1; other ints are i32, or i64 from 2^31 on, marked divisible by 16 where they are.
    Keyword arguments are constexprs, except compile options such as num_warps."""
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    kwargs = {k: v for k, v in kwargs.items() if k not in _OPTIONS}
    signature, constexprs, attrs = {}, dict(kwargs), {}
    for i, (name, v) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(v, torch.Tensor):
            signature[name] = "*" + _TT_DTYPES[v.dtype]
            attrs[(i,)] = _DIV16
        elif v == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = _DIV16
    signature.update((name, "constexpr") for name in kwargs)
    return signature, constexprs, attrs, options


def _key(kernel, spec):
    signature, constexprs, attrs, options = spec
    return (kernel.__name__, tuple(signature.items()), tuple((k, str(v)) for k, v in constexprs.items()),
            tuple(sorted(attrs)), tuple(sorted(options.items())))


def _unique(launches):
    """The distinct specialisations among recorded launches: {key: (kernel, spec)}, spec as `_specialisation`."""
    specs = {}
    for kernel, _, args, kwargs in launches:
        spec = _specialisation(kernel, args, kwargs)
        specs.setdefault(_key(kernel, spec), (kernel, spec))
    return specs


def _launch_all(dtype, B, Hq, Hm, T, Tm, D, gates=(None, "elementwise", "headwise"), affines=(False, True),
                alpha_dtype=None):
    """Calls forward and backward for every combination of operands and needed gradients; the launchers reduce
    these to the constexpr flags they can produce (e.g. no NEED_DA without alpha)."""
    for affine, gate in itertools.product(affines, gates):
        ops = _operands(dtype, B, Hq, Hm, T, Tm, D, gate, affine, alpha_dtype)
        et.forward(*ops)
        for needs in itertools.product((False, True), repeat=4):
            et.backward(ops[0], *ops, **dict(zip(("need_alpha", "need_alpha_ma", "need_gate", "need_m"), needs)))


def _sweep_dims():
    """Head dims that give every BLOCK_D the launchers choose for D in 1..256 (their BLOCK_T follows from it and
    the dtype), each once with D and the strides divisible by 16 (D = BLOCK_D, vector loads) and once with neither
    (D = BLOCK_D - 1, odd: scalar loads, the most registers). Triton specialises an int only on == 1 and on
    divisibility by 16, so these two stand for every D of a width."""
    widths = sorted({et.blocks(D, et.FWD_ELEMENTS)[1] for D in range(1, 257)})
    return sorted(set(widths) | {w - 1 for w in widths if w >= 4})


def _launch_nonfinite(dtype, B, Hq, Hkv, T, D, every=True):
    """The fused non-finite launchers (ops/nonfinite_triton.py) on meta operands as the ops make them (k and v
    transposed projections, seen per KV head): every flag combination, or (every=False) the heaviest of each kernel
    (copies with padding; alpha and seen)."""
    from affine_attention.ops import nonfinite_triton as nt

    k = _meta(B, T, Hkv, D, dtype=dtype).transpose(1, 2)
    keys = _meta(B, 1, 1, T, dtype=torch.bool)
    for write, pad in ((False, False), (True, False), (True, True)) if every else ((True, True),):
        nt.isolate_rows(k, k, keys if pad else None, write)
    q = _meta(B, Hq, T, D, dtype=dtype)
    alpha = _meta(B, T, Hq, dtype=dtype).transpose(1, 2)
    seen = _meta(B, Hkv, T, dtype=torch.bool)
    for a, s in itertools.product((None, alpha), (None, seen)) if every else ((alpha, seen),):
        nt.poison(q, q, a, s)


def _sweep(dtype, D):
    """The full sweep's specialisations for one dtype and head dim: GQA groups of 2, T = 3."""
    with _recorded_launches() as launches:
        _launch_all(dtype, 2, 4, 2, 3, 3, D)
        _launch_nonfinite(dtype, 2, 4, 2, 3, D)
    return _unique(launches)


_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# 64-bit indexing, read in the Triton IR: every pointer offset is i64, and no product is formed in i32 (where a
# (batch, head) pair, a row index or pair * T * D passes 2^31 the i32 product would wrap before widening).
_LOC = re.compile(r"\s+loc\(.*\)$")
_I32 = re.compile(r"^(tensor<[0-9x]*xi32>|i32)$")


def _narrow_indexing(ttir: str) -> tuple[int, list[str]]:
    """(number of tt.addptr, the TTIR lines that index in 32 bits): an addptr with an i32 offset, or an
    arith.muli in i32."""
    pointers, narrow = 0, []
    for line in ttir.splitlines():
        line = _LOC.sub("", line.strip())
        if " tt.addptr " in line or " arith.muli " in line:
            last_type = line.rsplit(": ", 1)[-1].rsplit(", ", 1)[-1]  # addptr: (pointer type, offset type)
            pointers += " tt.addptr " in line
            if _I32.match(last_type):
                narrow.append(line)
    return pointers, narrow


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    """Compiles a specialisation for sm_90 in a private cache (so every kernel reaches ptxas and yields its
    log); returns compile(kernel, spec) -> (compiled, registers, spill bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend to compile for sm_90")
    target = GPUTarget("cuda", 90, 32)
    with contextlib.ExitStack() as stack:
        for knobs in (triton.knobs.cache, triton.knobs.compilation, triton.knobs.nvidia):
            stack.enter_context(knobs.scope())
        triton.knobs.cache.dir = str(tmp_path_factory.mktemp("triton_cache"))
        triton.knobs.compilation.always_compile = True
        triton.knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v: registers and spills

        def compile_one(kernel, spec):
            signature, constexprs, attrs, options = spec
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                                    attrs=attrs), target=target, options=options)
            log = log.getvalue()
            regs, spills = _REGS.search(log), _SPILLS.search(log)
            assert regs and spills, log
            return compiled, int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))

        yield compile_one


def _describe(kernel, spec):
    """A specialisation in one line: kernel, pointer dtypes, constexpr flags and ints specialised to 1, i64 ints."""
    signature, constexprs, _, options = spec
    pointers = "/".join(sorted({v[1:] for v in signature.values() if v.startswith("*")}))
    wide = [k for k, v in signature.items() if v == "i64"]
    return (f"{kernel.__name__}[{pointers}] {' '.join(f'{k}={v}' for k, v in constexprs.items())} "
            f"{options}" + (f" i64: {wide}" if wide else ""))


def _compile_all(sm90, specs):
    """Compiles every specialisation; fails on an error, a spill or 32-bit indexing, listing every failing one.
    Returns (count, max registers)."""
    failures, max_regs = {}, 0
    for kernel, spec in specs.values():
        what = _describe(kernel, spec)
        try:
            compiled, regs, spilled = sm90(kernel, spec)
        except Exception as e:  # report every failing specialisation, not just the first
            failures[what] = [f"{type(e).__name__}: {str(e)[:2000]}"]
            continue
        max_regs = max(max_regs, regs)
        problems = []
        if not (compiled.asm.get("ptx") and compiled.asm.get("cubin")):
            problems.append("no PTX or cubin")
        if spilled:
            problems.append(f"{spilled} bytes of register spills (stores + loads) at {regs} registers")
        pointers, narrow = _narrow_indexing(compiled.asm["ttir"])
        if not pointers:
            problems.append("no tt.addptr in the TTIR: the 64-bit check read nothing")
        if narrow:
            problems.append(f"{len(narrow)} 32-bit index ops, e.g. {narrow[0]}")
        if problems:
            failures[what] = problems
    assert not failures, f"{len(failures)} of {len(specs)} specialisations failed:\n" + "\n".join(
        f"{what}: {'; '.join(problems)}" for what, problems in failures.items())
    return len(specs), max_regs


def _representative():
    """The default suite's specialisations: the heaviest (most registers: the widest tiles, D aligned to 16 or not)
    of each dtype with every flag on, and one of each other kind of launch: decoding (T = 1, MHA, GRP 1), D = 1,
    gates alone, a float gate and alpha in float32 with bfloat16 attention, and sizes past 2^31 elements (i64
    strides)."""
    with _recorded_launches() as launches:
        for dtype, D in itertools.product(DTYPES, (256, 100)):  # aligned and not: vector and scalar loads
            _launch_all(dtype, 2, 4, 2, 3, 3, D, gates=("elementwise",), affines=(True,))
        _launch_all(torch.float16, 2, 4, 2, 3, 3, 40, gates=("elementwise",), affines=(True,))
        _launch_all(torch.bfloat16, 4, 8, 8, 1, 1, 128, gates=("headwise",), affines=(True,))  # decoding
        _launch_all(torch.float32, 2, 4, 2, 3, 3, 1, gates=("elementwise",), affines=(True,))  # D = 1
        _launch_all(torch.float16, 2, 4, 2, 37, 37, 24, gates=("headwise",))  # D = 24, gates alone too
        _launch_all(torch.bfloat16, 2, 4, 1, 5, 1, 128, gates=("constant", "scale"), affines=(True,),
                    alpha_dtype=torch.float32)  # decoding mean (Tm = 1), mixed dtypes
        _launch_all(torch.float16, 1, 2, 1, 2**24 + 3, 2**24 + 3, 128, gates=("elementwise",), affines=(True,))
        for dtype, D in itertools.product(DTYPES, (256, 100)):
            _launch_nonfinite(dtype, 2, 4, 2, 3, D, every=False)
        _launch_nonfinite(torch.bfloat16, 1, 2, 1, 2**24 + 3, 128)  # every flag, i64 strides

    def wanted(key):
        """Every forward and non-finite pass; of the backwards, those with every gradient the operands allow or with none: the two
        extremes of live registers."""
        name, _, constexprs, _, _ = key
        if name != "_epilogue_bwd":
            return True
        on = {k: v == "True" for k, v in constexprs}
        needs = [on[n] for n in ("NEED_DA", "NEED_DAM", "NEED_DM", "NEED_DG")]
        return not any(needs) or needs == [on["AFFINE"]] * 3 + [on["GATE"]]

    return {key: spec for key, spec in _unique(launches).items() if wanted(key)}


def test_representative_specialisations_compile_for_sm90_without_spills(sm90):
    specs = _representative()
    assert any("i64" in dict(key[1]).values() for key in specs)  # the > 2^31-element case has i64 strides
    start = time.perf_counter()
    n, max_regs = _compile_all(sm90, specs)
    print(f"\nsm_90: {n} representative specialisations in {time.perf_counter() - start:.1f} s, "
          f"at most {max_regs} registers, no spills")


def test_the_sweep_covers_every_flag_combination_and_block_the_launchers_produce():
    """Cheap (no compiling): the launches of the slow sweep below hold every constexpr combination (flags, ACC,
    BLOCK_T x BLOCK_D for D in 1..256) for every dtype."""
    with _recorded_launches() as launches:
        for dtype, D in itertools.product(DTYPES, _sweep_dims()):
            _launch_all(dtype, 2, 4, 2, 3, 3, D)
    seen = {"_epilogue_fwd": set(), "_epilogue_bwd": set()}
    for kernel, _, args, kwargs in launches:
        seen[kernel.__name__].add((args[0].dtype, tuple((k, str(v)) for k, v in kwargs.items() if k not in _OPTIONS)))
    for name, elements in (("_epilogue_fwd", et.FWD_ELEMENTS), ("_epilogue_bwd", et.BWD_ELEMENTS)):
        for dtype in DTYPES:
            chosen = {et.blocks(D, et.tile_elements(elements, dtype)) for D in range(1, 257)}
            swept = {(int(dict(flags)["BLOCK_T"]), int(dict(flags)["BLOCK_D"])) for dt, flags in seen[name]
                     if dt == dtype}
            assert swept == chosen, (name, dtype)
    # Forward: AFFINE x (no gate, GATE, GATE with GATE_D). Backward: without alpha 1 + 2 gate kinds (GATE_D) x
    # NEED_DG, with alpha 2^3 needs x (1 + 2 x 2). At D = 1 a gate is never elementwise (GATE_D), leaving 2 x 2
    # forward and 1 + 2 and 8 x 3 backward. Each for 9 tile widths x 4 dtypes (ACC follows the dtype).
    assert len(seen["_epilogue_fwd"]) == (2 * 3 * 8 + 2 * 2) * 4
    assert len(seen["_epilogue_bwd"]) == ((5 + 8 * 5) * 8 + (3 + 8 * 3)) * 4


def test_the_sweep_covers_every_flag_of_the_fused_non_finite_kernels():
    """Cheap (no compiling): the slow sweep holds the non-finite kernels' every flag combination (isolate: the flags
    alone, copies, copies with padding; poison: alpha and seen each on or off) at every tile width, for every dtype."""
    specs = {}
    for dtype, D in itertools.product(DTYPES, _sweep_dims()):
        specs.update(_sweep(dtype, D))
    seen = {}
    for name, signature, constexprs, _, _ in specs:
        if name in ("_isolate_kernel", "_poison_kernel"):
            flags = tuple((k, v) for k, v in constexprs if k.isupper())  # not ints specialised to 1
            seen.setdefault(name, set()).add((dict(signature)["K" if name == "_isolate_kernel" else "O"], flags))
    widths = {et.blocks(D, et.tile_elements(et.FWD_ELEMENTS, torch.float32))[1] for D in range(1, 257)}
    assert len(seen["_isolate_kernel"]) == 3 * len(widths) * len(DTYPES)
    assert len(seen["_poison_kernel"]) == 4 * len(widths) * len(DTYPES)


@pytest.mark.slow
@pytest.mark.parametrize("D", _sweep_dims(), ids=lambda D: f"D{D}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_sweep_every_specialisation_compiles_for_sm90_without_spills(sm90, dtype, D):
    start = time.perf_counter()
    n, max_regs = _compile_all(sm90, _sweep(dtype, D))
    print(f"\nsm_90 {dtype} D={D}: {n} specialisations in {time.perf_counter() - start:.1f} s, "
          f"at most {max_regs} registers, no spills")
