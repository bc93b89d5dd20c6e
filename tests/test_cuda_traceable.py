"""The CUDA paths without a GPU, as GPU users run them: compiled with fullgraph (no host sync, no graph break) for
padding (its runs read eagerly), packing, windows and decoding, traced on meta tensors through the real aten flash
schemas; padded decoding hands the kernel the cache itself (no copy); the host-side mask checks run once per mask
object (one per model forward); SDPA on CUDA never reaches cuDNN."""

import pytest
import torch

from affine_attention.ops import affine_scaled_attention, sink_attention, softmax_attention
from affine_attention.ops import masks
from affine_attention.ops.backends import cuda_flash, sdpa
from affine_attention.ops.call import Score
from affine_attention.ops.masks import MaskSpec, Varlen, parse_mask, read_key_runs
from test_backends_cuda import _docs, _keys, model_backward, model_forward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def on_cuda(monkeypatch):
    """cuda_flash accepts meta (and float64 CPU) tensors as if they were bf16 on a GPU: the aten calls then run their
    meta kernels (or the CPU model of FA2 where a test installs it)."""
    monkeypatch.setattr(cuda_flash, "_platform_reason", lambda: None)
    supports = cuda_flash.CudaFlashBackend.supports
    monkeypatch.setattr(cuda_flash.CudaFlashBackend, "supports", lambda self, call: supports(
        self, call._replace(device_type="cuda", dtype=torch.bfloat16)))


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)


def _op(name):
    if name == "softmax":
        return lambda q, k, v, x, kw: softmax_attention(q, k, v, enable_gqa=True, backend="cuda_flash", **kw)
    if name == "sink":
        return lambda q, k, v, x, kw: sink_attention(q, k, v, x["sinks"], enable_gqa=True, backend="cuda_flash",
                                                     **kw)
    return lambda q, k, v, x, kw: affine_scaled_attention(q, k, v, x["alpha"], x["alpha_ma"], enable_gqa=True,
                                                          backend="cuda_flash", **kw)


def _meta_mask(kw, B, Hq, T, S):
    """The op keywords on meta; a key mask as the mask= the seam parses in a compiled layer: with the KeyRuns its
    eager mask function read from the values (here: the CPU mask's, which the meta copy stands for)."""
    meta = {n: (t.to("meta") if torch.is_tensor(t) else t) for n, t in kw.items()}
    if "attn_mask" not in kw:
        return meta
    keys = meta["attn_mask"]
    runs = read_key_runs(kw["attn_mask"])[1]._replace(keys=keys)
    return {"mask": parse_mask(keys, meta.get("is_causal", False), B, Hq, T, S, keys.device,
                               window=meta.get("window"), key_runs=runs)}


# (name, T, S, op keywords): training with right / left / both-sided padding, a fully padded row, queries after a
# cache, padded decoding (T = 1), windows without padding, packed documents with transformers' cu_seq_lens.
TRACE_CASES = [
    ("right_pad", 24, 24, {"is_causal": True, "attn_mask": _keys(3, 24, [(0, 17), (0, 24), (0, 5)])}),
    ("left_pad", 24, 24, {"is_causal": True, "attn_mask": _keys(3, 24, [(6, 24), (0, 24)])}),
    ("both_pad_open", 24, 24, {"attn_mask": _keys(3, 24, [(2, 20), (0, 0)])}),
    ("after_cache_pad", 7, 30, {"is_causal": True, "attn_mask": _keys(3, 30, [(4, 30), (0, 28)])}),
    ("decode_pad", 1, 40, {"is_causal": True, "attn_mask": _keys(3, 40, [(9, 40), (0, 40), (0, 33)])}),
    ("window", 24, 24, {"is_causal": True, "window": 5}),
    ("decode_window", 1, 40, {"is_causal": True, "window": 8}),
]


@pytest.mark.parametrize("op", ["softmax", "sink", "affine"])
@pytest.mark.parametrize("name,T,S,kw", TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_cuda_flash_traces_with_fullgraph(op, name, T, S, kw, on_cuda):
    """Forward and backward of the cuda_flash branch compile with fullgraph=True: nothing in the op, the mask or the
    varlen planning reads a tensor value on the host."""
    B, Hq, Hkv, D = 3, 8, 2, 64
    q, k, v = _meta(B, Hq, T, D), _meta(B, Hkv, S, D), _meta(B, Hkv, S, D)
    extra = {"sinks": _meta(Hq, dtype=torch.float32), "alpha": _meta(B, Hq, T, dtype=torch.float32),
             "alpha_ma": torch.full((Hq,), 0.5, device="meta")}
    fn = _op(op)
    mask_kw = _meta_mask(kw, B, Hq, T, S)

    # AOTAutograd traces the backward from the compiled forward (as in training); fullgraph: no break allowed.
    out = torch.compile(lambda q, k, v: fn(q, k, v, extra, mask_kw), backend="aot_eager", fullgraph=True)(q, k, v)
    assert out.shape == (B, Hq, T, D) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    leaves = [q, k, v] + ([extra["sinks"]] if op == "sink" else [extra["alpha"]] if op == "affine" else [])
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


def test_packed_documents_trace_with_transformers_cu_seqlens(on_cuda):
    """Packed rows compile with fullgraph when the collator's cu_seq_lens come along; without them the kernel refuses
    with the fix in its reason (their segments would need a host sync)."""
    S, Hq, D = 32, 4, 64
    docs = _docs(1, S, [[5, 19]]).to("meta")
    cu = torch.tensor([0, 5, 19, 32], dtype=torch.int32, device="meta")
    q, k, v = _meta(1, Hq, S, D), _meta(1, Hq, S, D), _meta(1, Hq, S, D)

    def step(q, k, v):
        mask = parse_mask(None, True, 1, Hq, S, S, q.device, document_ids=docs, varlen=Varlen(cu, cu, 14, 14))
        return softmax_attention(q, k, v, mask=mask, backend="cuda_flash")

    torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v).float().sum().backward()
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    mask = parse_mask(None, True, 1, Hq, S, S, torch.device("meta"), document_ids=docs)
    assert "cu_seq_lens" in cuda_flash.reason(mask, 1)


def test_key_padding_with_unknown_runs_is_refused_not_guessed(on_cuda):
    """Under compile (here: meta, whose values are unknown) without the runs read eagerly, a key mask may have holes
    (varlen segments would be wrong) or right padding beside a window: refused with the reason, never computed with
    a guess; with the runs read from the values, contiguous padding is served, and a window only without right
    padding."""
    meta = torch.device("meta")
    for spans, window in (([(0, 16)], None), ([(3, 16)], 4)):
        keys = _keys(2, 16, spans).to("meta")
        assert "cannot be checked" in cuda_flash.reason(parse_mask(keys, True, 2, 4, 16, 16, meta, window=window), 2)
    for spans, window, why in (([(3, 16)], 4, None), ([(0, 12)], None, None), ([(0, 12)], 4, "right key padding")):
        cpu = _keys(2, 16, spans)
        keys = cpu.to("meta")
        runs = read_key_runs(cpu)[1]._replace(keys=keys)
        got = cuda_flash.reason(parse_mask(keys, True, 2, 4, 16, 16, meta, window=window, key_runs=runs), 2)
        assert (got is None) if why is None else why in got, (spans, window, got)
    holes = _keys(2, 16, [(0, 16)])
    holes[0, ..., 5] = False
    runs = read_key_runs(holes)[1]._replace(keys=holes.to("meta"))
    assert "contiguous" in cuda_flash.reason(parse_mask(runs.keys, True, 2, 4, 16, 16, meta, key_runs=runs), 2)


def test_padded_decoding_hands_the_kernel_the_cache_itself(monkeypatch, on_cuda):
    """One query per row after a padded cache: the keys and values the kernel reads are views of the cache's own
    storage (no copy per layer per step), and the result is the reference's (through the CPU model of FA2)."""
    seen = []

    def spy(q, k, v, *args, **kw):
        seen.append((k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()))
        return model_forward(q, k, v, *args, **kw)

    monkeypatch.setattr(cuda_flash, "_ops", lambda: (spy, model_backward))
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, S, D = 3, 6, 2, 21, 8
    cache_k, cache_v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=torch.float64)
    keys = _keys(B, S, [(4, S), (0, S), (11, S)])
    out = softmax_attention(q, cache_k, cache_v, attn_mask=keys, is_causal=True, enable_gqa=True,
                            backend="cuda_flash")
    assert seen == [(cache_k.untyped_storage().data_ptr(), cache_v.untyped_storage().data_ptr())]
    ref = softmax_attention(q, cache_k, cache_v, attn_mask=keys, is_causal=True, enable_gqa=True, backend="exact")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_host_checks_run_once_per_mask_object(monkeypatch, on_cuda):
    """Every layer of a forward shares one MaskSpec: its host-side key-padding read (a sync) runs once for all of
    them, again only for a new mask object, and not at all where the runs came with the mask (read by the seam's
    mask function)."""
    calls = []
    real = masks.read_key_runs
    monkeypatch.setattr(masks, "read_key_runs", lambda keys: calls.append(1) or real(keys))
    monkeypatch.setattr(cuda_flash, "_ops", lambda: (model_forward, model_backward))
    q, k, v = (torch.randn(2, 4, 12, 8, dtype=torch.float64) for _ in range(3))
    keys = _keys(2, 12, [(0, 9), (2, 12)])
    mask = parse_mask(keys, True, 2, 4, 12, 12, q.device)
    for _ in range(5):  # five layers
        softmax_attention(q, k, v, mask=mask, backend="cuda_flash")
    assert len(calls) == 1
    softmax_attention(q, k, v, attn_mask=keys, is_causal=True, backend="cuda_flash")
    assert len(calls) == 2
    carried = parse_mask(keys, True, 2, 4, 12, 12, q.device, key_runs=real(keys)[1])
    softmax_attention(q, k, v, mask=carried, backend="cuda_flash")
    assert len(calls) == 2


def test_mask_given_once():
    q = torch.randn(1, 2, 4, 8)
    mask = parse_mask(None, True, 1, 2, 4, 4, q.device)
    with pytest.raises(ValueError, match="pass the mask once"):
        softmax_attention(q, q, q, mask=mask, is_causal=True)
    with pytest.raises(ValueError, match="parsed for T = 4"):
        softmax_attention(q[:, :, :3], q, q, mask=mask)
    assert isinstance(mask, MaskSpec)


def test_sdpa_on_cuda_never_uses_cudnn(monkeypatch):
    """The SDPA backend's call on CUDA runs with cuDNN attention disabled (flash, efficient and math allowed) and
    leaves the global choice as it was; on CPU it changes nothing."""
    flags = []

    def spy(q, k, v, **kw):
        flags.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                      torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return torch.empty_like(q)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    q = torch.empty(1, 2, 4, 8, device="meta")
    mask = parse_mask(None, True, 1, 2, 4, 4, q.device)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(sdpa, "_restricted", lambda t: True)
    sdpa.SdpaBackend().attention(q, q, q, mask, Score(0.3))
    assert flags[-1] == (False, True, True, True)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    monkeypatch.setattr(sdpa, "_restricted", lambda t: False)
    sdpa.SdpaBackend().attention(q, q, q, mask, Score(0.3))
    assert flags[-1][0] == before
    assert sdpa._restricted(torch.empty(1, device="meta")) is False


@pytest.mark.parametrize("variant", ["softmax", "sink", "affine_gated"])
def test_converted_model_trains_through_cuda_flash_with_fullgraph(variant, on_cuda):
    """A converted model's compiled training step (fullgraph) through the CUDA kernel, on meta tensors: packed rows
    with DataCollatorWithFlattening's FlashAttention kwargs (cu_seq_lens, max_length). (Padded rows in a model traced
    whole reach flex, their runs unknown: tests/test_backends_plan.py; compiled per block: test_compiled_key_runs.)"""
    from test_hf_common import tiny

    from affine_attention.ops.backends import use_backend

    model = tiny("llama", variant).to(torch.bfloat16).train().to("meta")
    T = 24
    cu = torch.tensor([0, 7, 15, 24], dtype=torch.int32, device="meta")
    ids = torch.zeros(1, T, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "position_ids": torch.zeros(1, T, dtype=torch.long, device="meta"),
              "labels": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 9, "max_length_k": 9}
    with use_backend("cuda_flash"):
        loss = torch.compile(model, backend="aot_eager", fullgraph=True)(use_cache=False, **inputs).loss
        loss.backward()
    assert loss.shape == () and all(p.grad is not None for p in model.parameters() if p.requires_grad)
