"""Argument checks shared by every attention op: clear ValueErrors naming the argument and the expected shape."""
from __future__ import annotations

import math

from torch import Tensor


def check_qkv(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> tuple[int, int, int, int, int, int]:
    """Validate q: (B, Hq, T, D), k and v: (B, Hkv, S, D); return (B, Hq, Hkv, T, S, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (B, H, T, D), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (B, H, T, D) like torch SDPA, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not isinstance(enable_gqa, bool):
        raise ValueError(f"enable_gqa must be a bool (True for grouped-query attention), got {enable_gqa!r}")
    B, Hq, T, D = q.shape
    if D == 0:
        raise ValueError(f"q, k and v need a head dimension D >= 1, got shape {tuple(q.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, S, D), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    Bk, Hkv, S, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(
            f"k and v must be (B={B}, Hkv, S, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if S == 0:
        raise ValueError(f"k and v must hold at least one key (S >= 1), got shape {tuple(k.shape)}; with no keys "
                         "there is nothing to attend to")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if Hkv != Hq:
        if not enable_gqa:
            raise ValueError(
                f"q has {Hq} heads but k/v have {Hkv}; pass enable_gqa=True for grouped-query attention")
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(f"grouped-query attention needs Hq ({Hq}) to be a multiple of Hkv ({Hkv})")
    return B, Hq, Hkv, T, S, D


def _check_float_on(name: str, x: Tensor, device) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; move it with `.to(q.device)`")


def check_per_query(name: str, x: Tensor, B: int, Hq: int, T: int, device=None) -> None:
    """Validate a per-query tensor x: (B, Hq, T), e.g. alpha, on `device` (q's) when given."""
    if not isinstance(x, Tensor) or tuple(x.shape) != (B, Hq, T):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape (B, Hq, T) = {(B, Hq, T)}, got {got}")
    _check_float_on(name, x, device)


def check_per_head(name: str, x: Tensor, Hq: int, device=None) -> None:
    """Validate a per-head tensor x: (Hq,), e.g. alpha_ma or sinks, on `device` (q's) when given."""
    if not isinstance(x, Tensor) or tuple(x.shape) != (Hq,):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape (Hq,) = ({Hq},), one value per query head, got {got}")
    _check_float_on(name, x, device)


def check_v_mean(v_mean: Tensor, B: int, Hq: int, Hkv: int | None, T: int, D: int, device) -> None:
    """Validate a precomputed mean of visible values: (B, Hkv or Hq, T or 1, D), floating point, on q's device.
    Hkv None (the epilogue alone, which does not know it): any head count that divides Hq."""
    heads = v_mean.shape[1] if isinstance(v_mean, Tensor) and v_mean.dim() == 4 else 0
    ok_heads = heads in (Hkv, Hq) if Hkv is not None else heads >= 1 and Hq % heads == 0
    if not isinstance(v_mean, Tensor) or v_mean.dim() != 4 or v_mean.shape[0] != B or v_mean.shape[-1] != D \
            or v_mean.shape[-2] not in (1, T) or not ok_heads:
        got = tuple(v_mean.shape) if isinstance(v_mean, Tensor) else type(v_mean).__name__
        want = f"(B, Hkv, T, D) = {(B, Hkv, T, D)}" if Hkv is not None else f"(B, Hkv, T|1, D) with Hkv dividing {Hq}"
        raise ValueError(f"v_mean must have shape {want}, got {got}")
    _check_float_on("v_mean", v_mean, device)


def check_scale(scale: float | None, D: int) -> float:
    """Default scale 1/sqrt(D), as torch SDPA."""
    if scale is None:
        return D ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number or None (1/sqrt(D)), got {scale!r}")
    return float(scale)


def check_bias_norm(bias_norm: str) -> None:
    if bias_norm not in ("visible", "full"):
        raise ValueError(
            f"bias_norm must be 'visible' (N_i = keys query i may see; the default) or 'full' "
            f"(N = key length, an ablation only), got {bias_norm!r}")




def check_softcap(softcap) -> float | None:
    """None (no cap) or a finite c > 0: logits become c * tanh(x / c)."""
    if softcap is None:
        return None
    if (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap)
            or softcap <= 0):
        raise ValueError(f"softcap must be None or a finite number > 0 (logits become softcap * tanh(x / softcap)), "
                         f"got {softcap!r}")
    return float(softcap)
