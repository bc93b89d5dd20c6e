"""The flex backend without a GPU: its wiring compiled with fullgraph on meta tensors (forward and backward, through
the real flex higher-order ops), its numerics through torch's compiled CPU flex forward (and, for the lse the sink
reads, flex's own dense implementation) against the float64 reference for every mask kind it serves, one block mask
per mask object, never the FLASH backend for sinks. With a GPU (`-m cuda`), outputs and every gradient in bf16."""

import pytest
import torch
import torch.nn.attention.flex_attention as fa

from affine_attention.ops import (
    affine_scaled_attention, affine_scaled_attention_reference, sink_attention, sink_attention_reference,
    softmax_attention, softmax_attention_reference,
)
from affine_attention.ops.backends import flex, get_backend
from affine_attention.ops.masks import parse_mask
from test_backends_cuda import _docs, _keys
from test_cuda_traceable import _fresh_dynamo  # noqa: F401  (autouse: every test starts with dynamo reset)

CUDA = torch.cuda.is_available()


@pytest.fixture
def as_cuda(monkeypatch):
    """flex accepts CPU and meta tensors as if they were on a GPU (flex validates devices: meta is let through)."""
    monkeypatch.setattr(flex, "_platform_reason", lambda: None)
    supports = flex.FlexBackend.supports
    monkeypatch.setattr(flex.FlexBackend, "supports", lambda self, call: supports(
        self, call._replace(device_type="cuda")))
    check = fa._validate_device
    monkeypatch.setattr(fa, "_validate_device", lambda q, k, v: None if q.device.type == "meta" else check(q, k, v))


def _holes(B, S):
    m = torch.ones(B, 1, 1, S, dtype=torch.bool)
    m[0, ..., 3:6] = False
    m[-1, ..., S - 2:] = False
    return m


def _dense(B, T, S):
    g = torch.Generator().manual_seed(3)
    m = torch.rand(B, 1, T, S, generator=g) < 0.6
    m[..., 0] = True
    return m


# Every mask kind flex serves (what cuda_flash refuses, and what it serves too): (T, S) and the op keywords.
MASKS = {
    "causal": lambda B, T, S: {"is_causal": True},
    "right_pad": lambda B, T, S: {"is_causal": True, "attn_mask": _keys(B, S, [(0, S - 4), (0, S)])},
    "left_pad": lambda B, T, S: {"is_causal": True, "attn_mask": _keys(B, S, [(3, S), (0, S)])},
    "holes_pad": lambda B, T, S: {"is_causal": True, "attn_mask": _holes(B, S)},
    "window": lambda B, T, S: {"is_causal": True, "window": 5},
    "window_right_pad": lambda B, T, S: {"is_causal": True, "window": 5, "attn_mask": _keys(B, S, [(0, S - 4)])},
    "documents": lambda B, T, S: {"is_causal": True, "document_ids": _docs(B, S, [[3, 9], [S - T + 1]])},
    "documents_pad": lambda B, T, S: {"is_causal": True, "document_ids": _docs(B, S, [[6]]),
                                      "attn_mask": _keys(B, S, [(0, S - 3), (2, S)])},
    "dense": lambda B, T, S: {"attn_mask": _dense(B, T, S)},
    "softcap": lambda B, T, S: {"is_causal": True, "softcap": 2.0},
    "softcap_window_pad": lambda B, T, S: {"is_causal": True, "softcap": 2.0, "window": 4,
                                           "attn_mask": _keys(B, S, [(0, S - 4), (2, S)])},
    "decode_pad": lambda B, T, S: {"is_causal": True, "attn_mask": _keys(B, S, [(4, S), (0, S - 2)])},
}
SHAPE = {"decode_pad": (1, 20)}  # (T, S); the others: 18 queries after 6 cached keys


def _shape(name):
    return SHAPE.get(name, (18, 24))


def _ops(op, q, k, v, extra, kw, backend):
    if op == "softmax":
        return softmax_attention(q, k, v, enable_gqa=True, backend=backend, **kw)
    if op == "sink":
        return sink_attention(q, k, v, extra["sinks"], enable_gqa=True, backend=backend, **kw)
    return affine_scaled_attention(q, k, v, extra["alpha"], extra["alpha_ma"], enable_gqa=True, backend=backend,
                                   **kw)


def _reference(op, q, k, v, extra, kw):
    q, k, v = (t.double() for t in (q, k, v))
    if op == "softmax":
        return softmax_attention_reference(q, k, v, enable_gqa=True, **kw)[0]
    if op == "sink":
        return sink_attention_reference(q, k, v, extra["sinks"].double(), enable_gqa=True, **kw)[0]
    return affine_scaled_attention_reference(q, k, v, extra["alpha"].double(), extra["alpha_ma"].double(),
                                             enable_gqa=True, **kw)[0]


def _inputs(name, dtype, device="cpu", B=2, Hq=4, Hkv=2, D=16, grad=False, seed=0):
    T, S = _shape(name)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
               for h, n in ((Hq, T), (Hkv, S), (Hkv, S)))
    extra = {"sinks": torch.randn(Hq, generator=g).to(device).requires_grad_(grad),
             "alpha": torch.rand(B, Hq, T, generator=g).to(device).requires_grad_(grad),
             "alpha_ma": torch.rand(Hq, generator=g).to(device)}
    kw = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in MASKS[name](B, T, S).items()}
    return q, k, v, extra, kw


def forward_error(name, dtype, op="softmax"):
    """max |flex - float64 reference| / max |reference| of one mask kind, through torch's compiled CPU flex forward
    (softmax, affine) or flex's dense implementation for the lse the sink needs (CPU compiles no lse)."""
    q, k, v, extra, kw = _inputs(name, dtype)
    with torch.no_grad():
        out = _ops(op, q, k, v, extra, kw, "flex")
    ref = _reference(op, q, k, v, extra, kw)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("name,dtype", [("softcap_window_pad", torch.float32),
                                        pytest.param("documents_pad", torch.bfloat16, marks=pytest.mark.slow)])
def test_compiled_cpu_forward_matches_float64(name, dtype, as_cuda):
    """One mask kind in the default suite, one slow (every kind, both dtypes: the exhaustive test below)."""
    assert forward_error(name, dtype) < TOL[dtype]


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("op", ["softmax", "affine"])
def test_compiled_cpu_forward_every_mask_kind(op, name, dtype, as_cuda):
    assert forward_error(name, dtype, op) < TOL[dtype]


@pytest.fixture
def dense_flex(monkeypatch, as_cuda):
    """flex's own dense implementation (the compile path with the eager backend): it returns the lse on CPU, which
    torch's compiled CPU flex does not; records the keywords every flex call received."""
    calls = []
    eager = torch.compile(fa.flex_attention, backend="eager", fullgraph=True)

    def spy(*args, **kw):
        calls.append(kw)
        return eager(*args, **kw)
    monkeypatch.setattr(flex, "_compiled", lambda: spy)
    return calls


@pytest.mark.parametrize("name", ["softcap_window_pad", "decode_pad"])
def test_sink_reads_flex_lse_exactly(name, dense_flex):
    """The sink through flex's lse (float32 inputs, against float64): the lse is the plain softmax's, and the call
    that asked for it was pinned to the Triton kernels (never FLASH, which has no lse gradient)."""
    assert forward_error(name, torch.float32, "sink") < 1e-5
    assert dense_flex and all(c["return_aux"].lse and c["kernel_options"] == {"BACKEND": "TRITON"}
                              for c in dense_flex)


TRACES = [("sink", "softcap_window_pad"), ("affine", "documents_pad")]  # the default suite's; every pair: exhaustive


@pytest.mark.parametrize("op,name", TRACES + [pytest.param(o, n, marks=pytest.mark.exhaustive) for o in (
    "softmax", "sink", "affine") for n in MASKS if (o, n) not in TRACES])
def test_traces_forward_and_backward_with_fullgraph(op, name, as_cuda):
    """The flex branch compiles with fullgraph=True, forward and backward, on meta tensors: no host read of a mask
    value, the block mask built inside the graph, the sink differentiated through flex's lse."""
    q, k, v, extra, kw = _inputs(name, torch.bfloat16, device="meta", D=64, grad=True)
    fn = torch.compile(lambda q, k, v: _ops(op, q, k, v, extra, kw, "flex"), backend="aot_eager", fullgraph=True)
    out = fn(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    out.float().sum().backward()
    leaves = [q, k, v] + ([extra["sinks"]] if op == "sink" else [extra["alpha"]] if op == "affine" else [])
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


def test_block_mask_built_once_per_mask_object(monkeypatch, dense_flex):
    """Every layer of a forward shares one MaskSpec: its block mask is built once for all of them; a new mask
    object (the next forward) builds its own."""
    builds = []
    real = flex.build_block_mask
    monkeypatch.setattr(flex, "build_block_mask", lambda *a: builds.append(1) or real(*a))
    q, k, v, extra, kw = _inputs("window_right_pad", torch.float32)
    mask = parse_mask(kw["attn_mask"], True, 2, 4, 18, 24, q.device, window=5)
    with torch.no_grad():
        outs = [softmax_attention(q, k, v, mask=mask, enable_gqa=True, backend="flex") for _ in range(4)]
    assert len(builds) == 1 and all(torch.equal(o, outs[0]) for o in outs)
    with torch.no_grad():
        softmax_attention(q, k, v, attn_mask=kw["attn_mask"], is_causal=True, window=5, enable_gqa=True,
                          backend="flex")
    assert len(builds) == 2


def test_converted_model_builds_one_block_mask_per_forward(monkeypatch, dense_flex):
    """A converted Mistral (sliding window) with right padding, every layer on flex: one block mask per forward for
    all its layers, and the logits of the float64 exact path."""
    from test_hf_common import tiny

    from affine_attention.ops.backends import use_backend

    builds = []
    real = flex.build_block_mask
    monkeypatch.setattr(flex, "build_block_mask", lambda *a: builds.append(1) or real(*a))
    model = tiny("mistral", "affine", sliding_window=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(2, 10, dtype=torch.long)
    attn[0, 7:] = 0
    with torch.no_grad(), use_backend("flex"):
        logits = model(input_ids=ids, attention_mask=attn).logits
    assert model.config.num_hidden_layers >= 2 and len(builds) == 1
    with torch.no_grad(), use_backend("exact"):
        ref = model.double()(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(logits[attn.bool()].double(), ref[attn.bool()], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_block_mask_builder_equals_eager():
    """On CUDA the block mask is built by the compiled create_block_mask: the same BlockMask as the eager one (here on
    CPU, for windows, documents and padding together, T not a multiple of the block size)."""
    B, T = 2, 300
    keys = torch.ones(B, 1, 1, T, dtype=torch.bool)
    keys[0, ..., 250:] = False
    keys[1, ..., :40] = False
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[:, 100:] += 1
    docs[:, 170:] += 1
    mask = parse_mask(keys, True, B, 4, T, T, torch.device("cpu"), window=64, document_ids=docs)
    eager = flex.build_block_mask(mask, B, 4, torch.device("cpu"))
    compiled = flex._compiled_create()(flex.mask_mod(mask), B, 1, T, T, device=torch.device("cpu"))
    pairs = [(a, b) for a, b in zip(eager.as_tuple(), compiled.as_tuple()) if torch.is_tensor(a)]
    assert len(pairs) >= 4 and all(torch.equal(a, b) for a, b in pairs)


def test_supports_and_options():
    """What flex refuses, in words; FLASH never chosen for an lse."""
    from affine_attention.ops.backends import Call

    b = get_backend("flex")
    mask = parse_mask(None, True, 1, 4, 8, 8, torch.device("cpu"))
    call = Call("cpu", torch.bfloat16, 1, 4, 2, 8, 8, 64, mask, True, True)
    assert "CUDA only" in b.supports(call)
    assert b.differentiable_lse and not b.has_lse and "softcap" in b.score
    assert flex.kernel_options(True) == {"BACKEND": "TRITON"} and flex.kernel_options(False) is None


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("op", ["softmax", "sink", "affine"])
def test_cuda_flex_against_float64_reference(op, name):
    """The real Triton kernels in bf16: output and every gradient within a few bf16 roundings of float64."""
    q, k, v, extra, kw = _inputs(name, torch.bfloat16, device="cuda", D=64, grad=True)
    out = _ops(op, q, k, v, extra, kw, "flex")
    leaves = [q, k, v] + ([extra["sinks"]] if op == "sink" else [extra["alpha"]] if op == "affine" else [])
    dout = torch.randn_like(out, dtype=torch.float32)
    grads = torch.autograd.grad(out.float(), leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rq, rk, rv = ref_leaves[:3]
    rextra = dict(extra, **({"sinks": ref_leaves[3]} if op == "sink" else {"alpha": ref_leaves[3]}
                            if op == "affine" else {}))
    ref = _reference(op, rq, rk, rv, rextra, kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item() < 3e-2


if __name__ == "__main__":  # the per-mask-kind error table of docs/kernels.md
    mp = pytest.MonkeyPatch()
    as_cuda.__wrapped__(mp)
    print("| mask | float32 | bfloat16 |\n|---|---|---|")
    for name in MASKS:
        errs = []
        for d in (torch.float32, torch.bfloat16):
            torch._dynamo.reset()  # one static compilation per kind: torch 2.13's CPU flex fails with dynamic shapes
            errs.append(forward_error(name, d))
        print(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errs) + " |", flush=True)
