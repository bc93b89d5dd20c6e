"""The training loss (KD and cross-entropy) computed from a causal LM's final hidden states in token chunks, as the
fused linear losses of liger-kernel do: no (tokens, vocab) tensor for a whole micro-batch ever exists.

For each chunk of `chunk` tokens: logits = post(h_chunk @ W^T), the loss terms of those tokens and their gradient
with respect to h_chunk and W, computed at once (an analytic gradient of the logits; the chain rule through the
family's logit transform), and accumulated; backward only scales the stored gradients. The teacher's logits are made
chunk by chunk from its final hidden states in the same way (no gradient). Peak memory is then a few
(chunk, vocab) float32 tensors plus W's gradient, instead of ~28 bytes per (token, vocab) entry.

The numbers equal `kd.kd_loss_full` / `kd_loss_topk` / `ce_loss` up to rounding: the head's matmul runs in the dtype
the full path runs it in (the autocast dtype, or the weights' dtype), everything after it in float32 (float64 for
float64 input). Families' logit transforms (`OutputHead.post`): Gemma 2/3's final_logit_softcapping, Granite's
logits_scaling; tests/test_kd_chunked.py checks the head against every family's own logits.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import float_acc

_NO_POSITIONS = torch.empty(0, dtype=torch.long)  # logits_to_keep that keeps no position: the model computes no logits


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside DDP / torch.compile wrappers (FSDP2 keeps the module itself)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


@dataclass(frozen=True)
class OutputHead:
    """A causal LM's output layer: logits = post(hidden @ weight^T), post = divide by `divide` (Granite's
    logits_scaling), then soft-cap c * tanh(x / c) at `softcap` (Gemma 2/3's final_logit_softcapping)."""

    weight: Tensor  # (V, H)
    divide: float | None = None
    softcap: float | None = None

    def post(self, raw: Tensor) -> Tensor:
        """raw: (n, V) = hidden @ weight^T -> the model's logits (n, V) in float32 (float64 for float64)."""
        z = raw.to(float_acc(raw.dtype))
        if self.divide is not None:
            z = z / self.divide
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def post_backward(self, raw: Tensor, grad: Tensor) -> Tensor:
        """d loss / d raw from d loss / d logits (grad, float32/64, updated in place); raw: (n, V) as in `post`."""
        if self.softcap is not None:
            x = raw.to(grad.dtype) / (self.divide or 1.0)
            grad.mul_(1 - torch.tanh(x / self.softcap) ** 2)  # d/dx c tanh(x / c) = 1 - tanh^2
        if self.divide is not None:
            grad.div_(self.divide)
        return grad


def output_head(model: nn.Module) -> OutputHead:
    """The output layer of `model` (possibly wrapped). Under FSDP2 call it after the root's forward: the root keeps
    its parameters unsharded from its forward to its backward, so the weight is then the full (V, H) tensor."""
    lm = unwrap(model)
    cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    return OutputHead(lm.get_output_embeddings().weight, getattr(cfg, "logits_scaling", None),
                      getattr(cfg, "final_logit_softcapping", None))


def final_hidden(model: nn.Module, inputs: dict) -> Tensor:
    """The final (normed) hidden states (B, T, H) of a forward of `model` on `inputs`, with no logits computed.

    The call goes through `model` itself (a DDP or FSDP2 root gathers, frees and reduces as usual); a forward hook
    on its decoder reads the hidden states, and `logits_to_keep` selects no position for the head."""
    box: list[Tensor] = []
    hook = unwrap(model).get_decoder().register_forward_hook(lambda mod, args, out: box.append(out.last_hidden_state))
    try:
        model(**inputs, logits_to_keep=_NO_POSITIONS)
    finally:
        hook.remove()
    return box[0]


def _compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (as `lm_head` under autocast), else the weight's."""
    dev = weight.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type) else \
        contextlib.nullcontext()


def teacher_chunk(targets: dict, s: slice) -> dict[str, Tensor]:
    """The teacher's targets for tokens s of a flattened micro-batch. targets: {"logits": (N, V)}, {"hidden": (N, Ht),
    "head": OutputHead} (logits made here, without gradient), or {"values", "indices": (N, k)} (top-k). Logits come
    back as a new float32 (float64) tensor that the loss may overwrite."""
    if "hidden" in targets:
        head: OutputHead = targets["head"]
        with torch.no_grad():
            return {"logits": head.post(F.linear(targets["hidden"][s], head.weight))}
    if "logits" in targets:
        logits = targets["logits"][s]
        return {"logits": logits.to(float_acc(logits.dtype), copy=True)}
    return {key: targets[key][s] for key in ("values", "indices")}


def _logsumexp(z: Tensor) -> Tensor:
    """(n, V) -> (n,) with one (n, V) temporary (torch.logsumexp makes two)."""
    peak = z.amax(dim=-1, keepdim=True)
    return (z - peak).exp_().sum(-1).log_().add_(peak[:, 0])


def _chunk_terms(z: Tensor, y: Tensor, teacher: dict | None, temperature: float, kd_alpha: float,
                 want_grad: bool) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """z: (n, V) student logits (float32/64; overwritten), y: (n,) targets -> (d loss_sum / dz or None, ce_sum,
    kd_sum or None), loss_sum = kd_alpha * kd_sum + (1 - kd_alpha) * ce_sum, kd_sum = T^2 * sum over tokens of KL.

    Few passes over (n, V), mostly in place: this is the loss's whole cost beside the matmuls. ce_sum is NaN when its
    weight is 0 and T != 1 (it would cost a pass of its own); at T = 1 it shares the KD's log-sum-exp."""
    t = temperature
    ce_w = 1.0 - kd_alpha if teacher is not None else 1.0
    z_y = z.gather(-1, y[:, None])[:, 0]  # (n,)
    lse1 = _logsumexp(z) if (t != 1.0 and ce_w > 0) or teacher is None else None
    soft1 = (z - lse1[:, None]).exp_() if want_grad and ce_w > 0 and t != 1.0 and teacher is not None else None
    kd_sum, grad = None, None
    if teacher is not None:
        zs = z.div_(t) if t != 1.0 else z
        lse = _logsumexp(zs)  # (n,)
        lse1 = lse if t == 1.0 else lse1
        if "logits" in teacher:
            log_p = teacher["logits"].to(z.dtype).div_(t)  # a chunk of its own (teacher_chunk)
            peak = log_p.amax(dim=-1, keepdim=True)
            p = (log_p - peak).exp_()
            norm = p.sum(-1, keepdim=True)
            p.div_(norm)
            log_p.sub_(norm.log_().add_(peak))
            # sum_j p_j (log p_j - log q_j) with log q = zs - lse and sum_j p_j = 1
            kd_sum = torch.dot(p.reshape(-1), log_p.sub_(zs).reshape(-1)) + lse.sum()
        else:  # top-k: the teacher renormalised on its k values, the student's full-vocabulary log-probabilities
            idx = teacher["indices"].long()
            log_p = torch.log_softmax(teacher["values"].to(z.dtype) / t, dim=-1)  # (n, k)
            p = log_p.exp()
            kd_sum = (p * (log_p - zs.gather(-1, idx))).sum() + lse.sum()
        kd_sum = (t * t) * kd_sum
        if want_grad and kd_alpha > 0:
            # d/dz T^2 sum_j p_j (log p_j - log q_j) = T (q - p), with p zero off the top-k support
            grad = zs.sub_(lse[:, None]).exp_()
            if t == 1.0 and ce_w > 0:  # the CE gradient's softmax is the same q
                grad.mul_(kd_alpha + ce_w)
                soft1 = None
            else:
                grad.mul_(kd_alpha * t)
            if "logits" in teacher:
                grad.sub_(p.mul_(kd_alpha * t))
            else:
                grad.scatter_add_(-1, idx, p.mul_(-kd_alpha * t))
    ce_sum = (lse1 - z_y).sum() if lse1 is not None else z.new_full((), float("nan"))
    if want_grad and ce_w > 0:
        if grad is None:  # no teacher, or kd_alpha = 0
            grad = soft1 if soft1 is not None else z.sub_(lse1[:, None]).exp_()
            grad.mul_(ce_w)
        elif soft1 is not None:
            grad.add_(soft1.mul_(ce_w))
        grad.scatter_add_(-1, y[:, None], grad.new_full((y.shape[0], 1), -ce_w))
    return grad, ce_sum, kd_sum


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, head, targets, teacher, temperature, kd_alpha, chunk):
        n_tok, dev = hidden.shape[0], hidden.device
        cdt = _compute_dtype(weight)
        acc = float_acc(hidden.dtype if hidden.dtype == torch.float64 else weight.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=dev) if need_w else None
        sums = torch.zeros(3, dtype=torch.float64, device=dev)  # loss, ce, kd (sums over tokens)
        w = weight.to(cdt)
        with _no_autocast(dev):
            for start in range(0, n_tok, chunk or n_tok):
                s = slice(start, start + (chunk or n_tok))
                h = hidden[s].to(cdt)
                raw = F.linear(h, w)  # (n, V)
                z = head.post(raw)
                t_chunk = teacher_chunk(teacher, s) if teacher is not None else None
                grad, ce_sum, kd_sum = _chunk_terms(z, targets[s], t_chunk, temperature, kd_alpha, need_h or need_w)
                loss_sum = ce_sum if kd_sum is None else kd_sum if kd_alpha == 1.0 else \
                    kd_alpha * kd_sum + (1 - kd_alpha) * ce_sum
                sums += torch.stack([loss_sum, ce_sum, kd_sum if kd_sum is not None else ce_sum.new_zeros(())]
                                    ).double()
                if grad is not None:
                    g = head.post_backward(raw, grad).div_(n_tok).to(cdt)  # (n, V): d mean loss / d raw
                    if need_h and grad_h.dtype == g.dtype:
                        torch.mm(g, w, out=grad_h[s])
                    elif need_h:
                        grad_h[s] = g @ w
                    if need_w and g.dtype == acc:
                        grad_w.addmm_(g.t(), h)
                    elif need_w:
                        grad_w.add_((g.t() @ h).to(acc))
                elif need_h:
                    grad_h[s] = 0
        # Kept on ctx, not saved tensors: backward hands them over as the only reference, so autograd stores the
        # weight's gradient as it is instead of copying (V, H) once more.
        ctx.grads = [grad_h, grad_w]
        ctx.weight_dtype = weight.dtype
        loss, ce, kd = (sums / n_tok).to(acc).unbind()
        ctx.mark_non_differentiable(ce, kd)
        return loss, ce, kd

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kd):
        grad_h, grad_w = ctx.grads
        ctx.grads = None  # a second backward through this graph would find nothing: it is not meant to run twice
        gh = None if grad_h is None else grad_h.mul_(grad_loss.to(grad_h.dtype))
        gw = None if grad_w is None else grad_w.mul_(grad_loss.to(grad_w.dtype)).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None, None


def head_loss(hidden: Tensor, head: OutputHead, targets: Tensor, *, teacher: dict | None = None,
              temperature: float = 1.0, kd_alpha: float = 1.0, chunk: int = 256) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, ce, kd) means over tokens; loss = kd_alpha * kd + (1 - kd_alpha) * ce with a teacher, ce without.

    hidden: (..., H) final hidden states; targets: (...) int64 next tokens; teacher: see `teacher_chunk` (flattened
    to (N, ...) like hidden). chunk: tokens per chunk, 0 for all at once. Only `loss` carries a gradient (to hidden
    and head.weight); the CE term gets none when its weight is 0, and its value is NaN then unless T = 1 (where it
    costs nothing); kd is 0 without a teacher."""
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0 (0: all tokens at once), got {chunk}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    if teacher is not None:
        teacher = {k: (v.reshape(flat.shape[0], v.shape[-1]) if isinstance(v, Tensor) else v)
                   for k, v in teacher.items()}
    return _ChunkedHeadLoss.apply(flat, head.weight, head, targets.reshape(-1), teacher, float(temperature),
                                  float(kd_alpha), int(chunk))


@torch.no_grad()
def topk_chunked(hidden: Tensor, head: OutputHead, k: int, chunk: int) -> dict[str, Tensor]:
    """The k largest logits per token, made chunk by chunk. hidden: (B, T, H) -> {"values": (B, T, k) in the
    weight's dtype, "indices": (B, T, k) int32}."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    values, indices = [], []
    for start in range(0, flat.shape[0], chunk or flat.shape[0]):
        z = head.post(F.linear(flat[start:start + (chunk or flat.shape[0])], head.weight))
        v, i = z.topk(k, dim=-1)
        values.append(v.to(head.weight.dtype))
        indices.append(i.to(torch.int32))
    shape = (*hidden.shape[:-1], k)
    return {"values": torch.cat(values).reshape(shape), "indices": torch.cat(indices).reshape(shape)}
