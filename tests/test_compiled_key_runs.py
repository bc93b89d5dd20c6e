"""Key padding under torch.compile without a host read in the graph: the seam's mask function, eager when only the
decoder layers are compiled, reads the mask once per forward and hands its runs (masks.KeyRuns) into the compiled
layers, which then serve contiguous padding and windows (all-True masks dropped) on cuda_flash; a mask with holes,
or one whose runs are unknown (the whole model traced), goes to flex, never to a NaN row; a graph made for one
mask's runs is not reused for another's. Run on CPU: cuda_flash through a CPU model of FA2 wrapped as custom ops
(opaque to dynamo, counted when they run), flex through its dense implementation, against float64."""

import pytest
import torch
import torch.nn.attention.flex_attention as fa
from test_backends_cuda import model_backward, model_forward
from test_cuda_traceable import _fresh_dynamo  # noqa: F401  (autouse: every test starts with dynamo reset)
from test_hf_common import perturb, tiny

from affine_attention.ops.backends import cuda_flash, flex, use_backend
from affine_attention.ops.masks import KeyRuns, parse_mask, read_key_runs

RAN = []  # one entry per call of the kernel model: ("fwd", varlen?)


@torch.library.custom_op("affine_attention_test::fa2_forward", mutates_args=())
def _fa2_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor | None,
                 cu_k: torch.Tensor | None, max_q: int, max_k: int, causal: bool, scale: float, left: int,
                 right: int) -> tuple[torch.Tensor, torch.Tensor]:
    RAN.append(("fwd", cu_q is not None))
    out, lse = model_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
                             window_size_left=left, window_size_right=right)[:2]
    return out, lse


@_fa2_forward.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right):
    lse = q.new_empty(q.shape[:1] + q.shape[2:3] + q.shape[1:2]) if cu_q is None else q.new_empty(
        q.shape[1], q.shape[0])
    return torch.empty_like(q), lse


def _ops():
    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale, window_size_left,
            window_size_right):
        return (*_fa2_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_size_left,
                              window_size_right), None, None, None)
    return fwd, model_backward


@pytest.fixture
def fake_cuda(monkeypatch):
    """cuda_flash and flex answer CPU float32 calls as bf16 / float32 calls on a GPU; cuda_flash's kernel is the CPU
    model of FA2 (opaque to dynamo, so a compiled graph keeps the call), flex runs its dense implementation."""
    RAN.clear()
    monkeypatch.setattr(cuda_flash, "_ops", _ops)
    for mod, cls in ((cuda_flash, cuda_flash.CudaFlashBackend), (flex, flex.FlexBackend)):
        monkeypatch.setattr(mod, "_platform_reason", lambda: None)
        supports = cls.supports
        dtype = torch.bfloat16 if cls is cuda_flash.CudaFlashBackend else None
        monkeypatch.setattr(cls, "supports", lambda self, call, s=supports, d=dtype: s(
            self, call._replace(device_type="cuda", dtype=d or call.dtype)))
    eager_flex = torch.compile(fa.flex_attention, backend="eager", fullgraph=True)
    monkeypatch.setattr(flex, "_compiled", lambda: eager_flex)


def _blocks(model):
    for layer in model.model.layers:
        layer.compile(backend="eager", fullgraph=True, dynamic=False)
    return model


def _logits(model, ids, attn):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn, use_cache=False).logits


def test_compiled_blocks_get_the_runs_the_eager_mask_function_read(fake_cuda):
    """A sliding-window Mistral compiled per block (fullgraph): left padding runs on cuda_flash in every layer
    (varlen), an all-True mask is dropped so the window gets cuda_flash's dense call, a mask with holes goes to flex;
    each equals the float64 exact path, with no NaN. The graph made for contiguous runs was not reused for the holes:
    the runs are guarded values of the mask object, not facts remembered from an earlier mask."""
    ref = tiny("mistral", "softmax", sliding_window=4)
    perturb(ref)
    model = tiny("mistral", "softmax", sliding_window=4)
    model.load_state_dict(ref.state_dict())
    ref.double()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    left, full, holes = (torch.ones(2, 10, dtype=torch.long) for _ in range(3))
    left[0, :3] = 0
    holes[1, 3:5] = 0
    cases = [(left, [("fwd", True)] * layers), (full, [("fwd", False)] * layers), (holes, [])]
    with use_backend("exact"):  # first: forcing a backend changes what compiled graphs guard on
        want = [_logits(ref, ids, attn) for attn, _ in cases]
    _blocks(model)
    for (attn, ran), w in zip(cases, want):
        RAN.clear()
        got = _logits(model, ids, attn)
        assert RAN == ran, (attn, RAN)
        real = attn.bool()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[real].double(), w[real], rtol=1e-4, atol=1e-4)
    assert layers >= 2


def test_runs_hold_only_for_the_mask_they_were_read_from():
    """KeyRuns name the tensor they were read from: parse_mask and MaskSpec refuse them beside another tensor (also a
    copy with equal values, and a MaskSpec rebuilt with other keys), so a fact cannot move to a different mask."""
    keys = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    keys[0, ..., 6:] = False
    every, runs = read_key_runs(keys)
    assert (every, runs.contiguous, runs.right) == (False, True, True) and runs.keys is keys
    spec = parse_mask(keys, True, 2, 4, 8, 8, keys.device, key_runs=runs)
    assert spec.runs() == (spec.keys, True, True)
    for other in (keys.clone(), None):
        with pytest.raises(ValueError, match="read from attn_mask itself"):
            parse_mask(other, True, 2, 4, 8, 8, keys.device, key_runs=runs)
    import dataclasses
    with pytest.raises(ValueError, match="hold for the tensor they were read from"):
        dataclasses.replace(spec, keys=keys.clone())
    with pytest.raises(ValueError, match="varies over queries"):
        dense = torch.ones(2, 1, 8, 8, dtype=torch.bool)
        parse_mask(dense, True, 2, 4, 8, 8, keys.device, key_runs=KeyRuns(dense, True, False))
    assert read_key_runs(keys.to("meta")) is None
    holes = keys.clone()
    holes[1, ..., 2] = False
    assert read_key_runs(holes)[1][1:] == (False, True) and read_key_runs(torch.ones_like(keys))[0]


def test_mask_function_reads_eagerly_and_keeps_the_mask_when_traced():
    """The registered mask function: eagerly an all-True mask is dropped and a padded one carries its runs; traced
    (the whole model compiled), the key mask stays, its runs unknown (a read would break the graph)."""
    from affine_attention.hf.attention import structured_mask

    pad = torch.ones(2, 6, dtype=torch.long)
    pad[1, :2] = 0
    assert structured_mask(2, 6, 6, attention_mask=torch.ones(2, 6, dtype=torch.long)) is None
    eager = structured_mask(2, 6, 6, attention_mask=pad)
    assert eager.runs.keys is eager.keys and (eager.runs.contiguous, eager.runs.right) == (True, False)
    traced = torch.compile(lambda m: structured_mask(2, 6, 6, attention_mask=m), backend="eager", fullgraph=True)
    for m in (pad, torch.ones(2, 6, dtype=torch.long)):
        got = traced(m)
        assert got.runs is None and torch.equal(got.keys[:, 0, 0], m.bool())


def test_traced_key_mask_with_unknown_runs_goes_to_flex_not_nan(fake_cuda):
    """An op traced with its key mask (as in a model compiled whole: nothing read the runs): cuda_flash refuses it and
    flex serves it, equal to the float64 reference, where a row with holes once came back nan."""
    from affine_attention.ops import softmax_attention, softmax_attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 16, generator=g) for h in (4, 2, 2))
    keys = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    keys[0, ..., 4:7] = False
    keys[1, ..., :2] = False
    op = torch.compile(lambda q, k, v, m: softmax_attention(q, k, v, attn_mask=m, is_causal=True, enable_gqa=True),
                       backend="eager", fullgraph=True, dynamic=False)
    got = op(q, k, v, keys)
    want = softmax_attention_reference(q.double(), k.double(), v.double(), attn_mask=keys, is_causal=True,
                                       enable_gqa=True)[0]
    assert RAN == [] and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
