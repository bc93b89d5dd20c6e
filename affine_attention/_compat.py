"""Small dtype helpers shared across layers."""
import torch


def as_dtype(x, dtype: torch.dtype):
    """x in dtype, without a call when it already is (a no-op `.to` still costs a dispatch, on every op of every decoding step)."""
    return x if x.dtype == dtype else x.to(dtype)


def float_acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for sums over keys: float32, or float64 when the input is float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32
