"""Bad input raises ValueError naming the argument and what was expected."""
import pytest
import torch

from affine_attention.ops import affine_scaled_attention, sink_attention

B, H, T, D = 2, 4, 5, 8


def _qkv(hkv=H):
    return torch.randn(B, H, T, D), torch.randn(B, hkv, T, D), torch.randn(B, hkv, T, D)


def _alpha():
    return torch.rand(B, H, T), torch.rand(H)


@pytest.mark.parametrize("case, match", [
    (lambda: affine_scaled_attention(torch.randn(B, T, D), *_qkv()[1:], *_alpha()), r"q must have rank 4"),
    (lambda: affine_scaled_attention(*_qkv(hkv=3), *_alpha(), enable_gqa=True), r"multiple of Hkv"),
    (lambda: affine_scaled_attention(*_qkv(hkv=2), *_alpha()), r"enable_gqa=True"),
    (lambda: affine_scaled_attention(*_qkv(), torch.rand(B, T, H), torch.rand(H)), r"alpha must have shape"),
    (lambda: affine_scaled_attention(*_qkv(), torch.rand(B, H, T), torch.rand(H, 1)), r"alpha_ma must have shape"),
    (lambda: sink_attention(*_qkv(), torch.rand(H + 1)), r"sinks must have shape \(Hq,\)"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), attn_mask=torch.ones(B, 1, T, T + 1, dtype=torch.bool)),
     r"attn_mask .* does not broadcast"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), attn_mask=torch.zeros(B, 1, T, T)),
     r"attn_mask must be a boolean tensor"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), bias_norm="mean"), r"bias_norm must be"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), scale=-1.0), r"scale must be a finite positive"),
    (lambda: affine_scaled_attention(torch.randn(B, H, T, D), torch.randn(B, H, T, D + 1),
                                     torch.randn(B, H, T, D + 1), *_alpha()), r"k and v must be"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), v_mean=torch.zeros(B, H, T, D + 1)), r"v_mean must have"),
])
def test_bad_input_raises_clear_value_error(case, match):
    with pytest.raises(ValueError, match=match):
        case()


def test_a_parsed_mask_of_another_batch_head_count_or_device_is_named():
    """mask= (a MaskSpec parsed before, e.g. once per model forward) made for another call once failed deep in a
    kernel with a broadcasting RuntimeError; every op names the mismatch instead."""
    from affine_attention.ops.masks import parse_mask

    q, k, v = _qkv(hkv=2)
    keys = torch.ones(B + 1, 1, 1, T, dtype=torch.bool)
    keys[0, ..., 0] = False
    docs = torch.tensor([[0, 0, 1, 1, 1]] * (B + 1))
    dense = torch.ones(B, H - 1, T, T, dtype=torch.bool).tril()
    cases = [
        (parse_mask(keys, True, B + 1, H, T, T, q.device),
         rf"parsed for B = {B + 1} \(its keys: \({B + 1}, 1, 1, {T}\)\), but q has B = {B}"),
        (parse_mask(None, True, B + 1, H, T, T, q.device, document_ids=docs),
         rf"parsed for B = {B + 1} \(its documents"),
        (parse_mask(dense, False, B, H - 1, T, T, q.device),
         rf"parsed for Hq = {H - 1} \(its dense.*but q has Hq = {H}"),
        (parse_mask(keys[:B].to("meta"), True, B, H, T, T, torch.device("meta")),
         r"parsed on meta \(its keys\), but q is on cpu"),
    ]
    for mask, match in cases:
        for op in (lambda: affine_scaled_attention(q, k, v, *_alpha(), mask=mask, enable_gqa=True),
                   lambda: sink_attention(q, k, v, torch.rand(H), mask=mask, enable_gqa=True)):
            with pytest.raises(ValueError, match=match):
                op()
