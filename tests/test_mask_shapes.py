"""Every mask shape transformers passes through a model keeps its meaning after `convert` (issue 33, item 4).

A user may hand the model a 2D padding mask, or a 4D mask of shape (B, 1, 1, S), (B, 1, T, S) or (B, H, T, S), as
booleans (True = may attend) or as a float additive mask (0 = attend, a large negative = hidden). The unconverted
model reads each one in its own way (a 4D mask is used as given: a (B, 1, 1, S) mask lets every query see every
unmasked key); the converted softmax model must give the same logits, or refuse the mask by name.
"""
import pytest
import torch

from test_hf_common import VOCAB, tiny

B, T = 2, 7


def _masks():
    gen = torch.Generator().manual_seed(3)
    keys = torch.ones(B, T, dtype=torch.bool)
    keys[1, :2] = False  # left padding on the second row
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    dense = (torch.rand(B, 1, T, T, generator=gen) > 0.4) | torch.eye(T, dtype=torch.bool)
    per_head = (torch.rand(B, 4, T, T, generator=gen) > 0.4) | torch.eye(T, dtype=torch.bool)
    return {
        "2d": keys.long(),
        "b11s_bool": keys[:, None, None, :],  # bidirectional over the unmasked keys
        "b1ts_bool_causal": causal[None, None] & keys[:, None, None, :],
        "b1ts_bool_dense": dense,
        "bhts_bool": per_head,
        "b1ts_float": torch.zeros(B, 1, T, T).masked_fill(~(causal[None, None] & keys[:, None, None, :]), -1e9),
    }


@pytest.mark.parametrize("shape", list(_masks()))
def test_converted_softmax_reads_every_mask_shape_as_the_unconverted_model(shape):
    mask = _masks()[shape]
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    base = tiny("llama")
    with torch.no_grad():
        try:
            want = base(ids, attention_mask=mask).logits
        except Exception as e:  # noqa: BLE001  transformers itself refuses this shape: nothing to keep
            pytest.skip(f"the unconverted model refuses {shape}: {e}")
        conv = tiny("llama", "softmax")
        try:
            got = conv(ids, attention_mask=mask).logits
        except ValueError as e:
            assert "mask" in str(e), f"the refusal of {shape} must name the mask: {e}"
            return
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"{shape}: converted logits differ from the unconverted model's: {m}")


def _block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device="cpu")


@pytest.mark.parametrize("mask", [_block_mask, object, lambda: torch.zeros(B, 1, T, T),
                                  lambda: torch.ones(B, T, T, dtype=torch.bool)],
                         ids=["flex_blockmask", "blockmask_like", "float_4d", "bool_3d"])
def test_masks_the_seam_cannot_read_are_refused_by_name(mask):
    """flex's BlockMask (what transformers' flex masks hand over), any other object, a float 4D mask or a 3D mask
    reaching the attention function is a ValueError that names the mask, never read as something else."""
    from affine_attention.hf.attention import _variant_mask

    mask = mask()
    with pytest.raises(ValueError, match="mask"):
        _variant_mask(mask, B, T, T, training=False)


def test_the_seams_key_padding_is_a_tensor_transformers_reads_back_and_keeps():
    """generate builds the masks of a static cache with the registered mask function and hands them back to the
    model, whose mask code asks `.ndim` / `.shape` and passes a 4D tensor on unchanged: the seam's key padding is such
    a tensor, keeps its type through generate's `.contiguous()` (also made from a non-contiguous slice), every op on it
    gives a plain tensor (nothing downstream computes on the marker type), and handed to the model it still means
    causal + padding."""
    from affine_attention.hf.attention import KeyPadding, structured_mask

    pad = torch.ones(B, T + 3, dtype=torch.long)
    pad[1, 3:5] = 0
    mask = structured_mask(B, T, T, attention_mask=pad[:, 3:])  # a non-contiguous slice of a wider mask
    assert isinstance(mask, KeyPadding) and isinstance(mask, torch.Tensor) and mask.ndim == 4
    assert mask.contiguous() is mask and torch.equal(mask.keys, pad[:, None, None, 3:].bool())
    assert mask.runs.keys is mask.keys
    assert type(mask[:, 0, 0]) is torch.Tensor and type(mask & mask) is torch.Tensor
    model = tiny("llama", "softmax")
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, attention_mask=pad[:, 3:]).logits
        got = model(ids, attention_mask=mask).logits
    real = pad[:, 3:].bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=0)
