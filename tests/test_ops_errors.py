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
