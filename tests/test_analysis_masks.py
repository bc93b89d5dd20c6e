"""The diagnostics see the mask the fast path used: sliding windows, packed documents and padding reach the recorder
through the one parsed mask (MaskSpec), so its statistics equal a direct computation under that same mask."""
import pytest
import torch

from affine_attention.analysis.capture import AttentionRecorder
from affine_attention.analysis.layer_stats import LayerStats
from affine_attention.ops import visible_mask
from affine_attention.ops.masks import parse_mask
from test_analysis_capture import HKV, HQ, HID, D, ToyModel, _randomise
from test_hf_common import tiny

KEYS = ("first_token_mass", "entropy", "mean_total_mass", "mean_total_mass_sink_excluded")


def _direct(variant, q, k, v, x, kw, query_mask=None):
    """LayerStats of the variant's readable reference under the op keywords `kw`, computed in one piece."""
    _, w, extras = variant.reference(q, k, v, x, **kw)
    vis = visible_mask(kw.get("attn_mask"), kw.get("is_causal", False), q.shape[2], k.shape[2], q.device,
                       window=kw.get("window"), document_ids=kw.get("document_ids"))
    stats = LayerStats()
    stats.update(w, vis, query_mask, sink_mass=extras.get("sink_mass"))
    return stats.result()


CASES = {
    "window": lambda B, T: {"is_causal": True, "window": 3},
    "documents": lambda B, T: {"is_causal": True, "document_ids": torch.tensor([[0] * 4 + [1] * (T - 4),
                                                                                [0] * 6 + [1] * (T - 6)])},
    "window_documents": lambda B, T: {"is_causal": True, "window": 2,
                                      "document_ids": torch.tensor([[0] * 5 + [1] * (T - 5)] * B)},
}


@pytest.mark.parametrize("variant", ["softmax", "sink", "affine"])
@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_recorder_uses_the_layers_own_mask(variant, case):
    """A layer called with window= / document_ids= (as the transformers seam calls it, through its MaskSpec): the
    recorded statistics equal the direct computation under that mask, chunked or not, and differ from what the
    plain causal mask would give (so the test sees a lost window or documents)."""
    model = _randomise(ToyModel(variant, layers=1))
    att = model.layers[0]["self_attn"]
    B, T = 2, 9
    x = torch.randn(B, T, HID, dtype=torch.float64)
    kw = CASES[case](B, T)
    q = att.q_proj(x).view(B, T, HQ, D).transpose(1, 2)
    k = att.k_proj(x).view(B, T, HKV, D).transpose(1, 2)
    v = att.v_proj(x).view(B, T, HKV, D).transpose(1, 2)
    mask = parse_mask(kw.get("attn_mask"), True, B, HQ, T, T, x.device, window=kw.get("window"),
                      document_ids=kw.get("document_ids"))
    for chunk in (2, 256):
        with AttentionRecorder(model, chunk=chunk) as rec:
            att.attn_variant(q, k, v, x, mask=mask)
        got = rec.results()[0].stats
        want = _direct(att.attn_variant, q, k, v, x, kw)
        for key in KEYS:
            torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12, msg=f"{key}, chunk {chunk}")
    causal_only = _direct(att.attn_variant, q, k, v, x, {"is_causal": True})
    assert not torch.allclose(got["first_token_mass"], causal_only["first_token_mass"])


@torch.no_grad()
def test_sliding_window_model_reports_its_windowed_first_token_mass():
    """A converted tiny Mistral (sliding window 4, shorter than the sequence): the recorded first-token mass is
    the windowed one, equal to the reference computed with the window (queries past the window give it 0)."""
    model = tiny("mistral", "softmax").double()
    window = model.config.sliding_window
    T = 12
    assert window < T
    ids = torch.randint(0, 100, (2, T), generator=torch.Generator().manual_seed(0))
    captured = {}
    variant = model.model.layers[0].self_attn.attn_variant
    hook = variant.register_forward_pre_hook(lambda m, a, kw: captured.update(args=a, kw=kw), with_kwargs=True)
    with AttentionRecorder(model, layers=[0], chunk=5) as rec:
        model(ids, use_cache=False)
    hook.remove()
    call, x = captured["args"]
    q, k, v = call.q, call.k, call.v
    assert call.mask.window == window
    want = _direct(variant, q, k, v, x, {"is_causal": True, "window": window})
    got = rec.results()[0].stats
    for key in KEYS:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12, msg=key)
