"""Small dtype helpers shared across layers."""
import torch


def float_acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for sums over keys: float32, or float64 when the input is float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32
