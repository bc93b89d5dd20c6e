"""The training loss (KD and cross-entropy) computed from a causal LM's final hidden states in token chunks, as the
fused linear losses of liger-kernel do: no (tokens, vocab) tensor for a whole micro-batch ever exists.

For each chunk of `chunk` tokens: logits = post(h_chunk @ W^T), the loss terms of those tokens and their gradient
with respect to h_chunk and W, computed at once (an analytic gradient of the logits; the chain rule through the
family's logit transform), and accumulated; backward only scales the stored gradients. The teacher's logits are made
chunk by chunk from its final hidden states in the same way (no gradient). A chunk's logits are held
vocabulary-major, (vocab, chunk): the CPU's matmul then needs no workspace of their size. Peak memory is then two
(vocab, chunk) float32 tensors (student, teacher) plus W's gradient, instead of ~28 bytes per (token, vocab) entry.

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

CHUNK_TOKENS = 128  # the default chunk (train.loss_chunk_tokens)
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
        """raw: hidden @ weight^T, in any layout (the loss's is (V, n)) -> the model's logits, same shape, in float32
        (float64 for float64)."""
        z = raw.to(float_acc(raw.dtype))
        if self.divide is not None:
            z = z / self.divide
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def post_backward(self, raw: Tensor, grad: Tensor) -> Tensor:
        """d loss / d raw from d loss / d logits (grad, float32/64, updated in place); raw as in `post`."""
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
    """The dtype the head's matmul runs in: autocast's when it is on (as `lm_head` would), else the weight's."""
    dev = weight.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type) else \
        contextlib.nullcontext()


def _head_raw(hidden: Tensor, weight: Tensor) -> Tensor:
    """hidden: (n, H), weight: (V, H) -> weight @ hidden^T: (V, n), the raw logits vocabulary-major. On the CPU MKL
    makes this product with a ~2 MiB workspace, hidden @ weight^T (n, V) with one as large as its output."""
    return torch.mm(weight, hidden.t())


def teacher_chunk(targets: dict, s: slice) -> dict[str, Tensor]:
    """The teacher's targets for tokens s of a flattened micro-batch. targets: {"logits": (N, V)}, {"hidden": (N, Ht),
    "head": OutputHead} (logits made here, without gradient), or {"values", "indices": (N, k)} (top-k). Logits come
    back vocabulary-major, (V, n), as a new float32 (float64) tensor that the loss may overwrite."""
    if "hidden" in targets:
        head: OutputHead = targets["head"]
        with torch.no_grad():
            return {"logits": head.post(_head_raw(targets["hidden"][s], head.weight))}
    if "logits" in targets:
        logits = targets["logits"][s]
        out = logits.new_empty(logits.shape[::-1], dtype=float_acc(logits.dtype))
        return {"logits": out.copy_(logits.t())}
    return {key: targets[key][s] for key in ("values", "indices")}


def _logsumexp(z: Tensor) -> Tensor:
    """(V, n) -> (n,) over the vocabulary, with one (V, n) temporary (torch.logsumexp makes two)."""
    peak = z.amax(dim=0)
    return (z - peak).exp_().sum(0).log_().add_(peak)


_KL_BLOCK = 1 << 20  # elements of the KL's probability temporary (4 MiB in float32)


def _kl_rows(log_p: Tensor, log_q: Tensor, grad_scale: float | None, a: float) -> Tensor:
    """sum p (log p - log q) over (V, n) log-probabilities, p = exp(log_p), made in blocks of vocabulary rows so
    that no third (V, n) tensor exists; log_p is overwritten. With grad_scale, log_q becomes grad_scale * q - a * p
    block by block (the gradient's KD part, and the CE's softmax at T = 1)."""
    rows = max(1, _KL_BLOCK // log_p.shape[1])
    kd = log_p.new_zeros(())
    for r in range(0, log_p.shape[0], rows):
        lp, lq = log_p[r:r + rows], log_q[r:r + rows]
        p = lp.exp()
        kd += torch.dot(p.reshape(-1), lp.sub_(lq).reshape(-1))
        if grad_scale is not None:
            lq.exp_().mul_(grad_scale).sub_(p, alpha=a)
    return kd


def _chunk_terms(z: Tensor, y: Tensor, teacher: dict | None, temperature: float, kd_alpha: float,
                 want_grad: bool) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """z: (V, n) student logits, vocabulary-major (float32/64; overwritten), y: (n,) targets -> (d loss_sum / dz
    (V, n) or None, ce_sum, kd_sum or None), loss_sum = kd_alpha * kd_sum + (1 - kd_alpha) * ce_sum, kd_sum = T^2 *
    sum over tokens of KL.

    In place where it can be, with torch's fused log-softmax over the vocabulary: two (V, n) tensors live (student,
    teacher), a third only for the CE's softmax when the CE is mixed in at T != 1. ce_sum is NaN when its weight is 0
    and T != 1 (it would cost a pass of its own); at T = 1 it is read off the KD's log-probabilities."""
    t = temperature
    ce_w = 1.0 - kd_alpha if teacher is not None else 1.0
    n = y.shape[0]
    ce_sum = z.new_full((), float("nan"))
    soft1 = None  # softmax(z) for the CE gradient when the KD works at another temperature
    if teacher is not None and t != 1.0 and ce_w > 0:
        lse1 = _logsumexp(z)
        ce_sum = (lse1 - z.gather(0, y[None])[0]).sum()
        soft1 = (z - lse1).exp_() if want_grad else None
    log_q = torch.log_softmax(z.div_(t) if t != 1.0 else z, dim=0, out=z)  # (V, n), at temperature T
    if t == 1.0:
        ce_sum = -log_q.gather(0, y[None]).sum()
    # d/dz of T^2 sum_j p_j (log p_j - log q_j) is T (q - p) (p zero off a top-k support); of CE: softmax(z) - onehot.
    # At T = 1 the CE's softmax is q itself.
    a = kd_alpha * t
    q_scale = ce_w if teacher is None else a + (ce_w if t == 1.0 else 0.0)
    kd_sum, made = None, False  # made: log_q holds q_scale * q - a * p already
    if teacher is not None and "logits" in teacher:
        log_p = teacher["logits"].to(z.dtype)  # a chunk of its own (teacher_chunk): overwritten
        log_p = torch.log_softmax(log_p.div_(t) if t != 1.0 else log_p, dim=0, out=log_p)
        kd_sum, made = _kl_rows(log_p, log_q, q_scale if want_grad else None, a), want_grad
        del log_p
    elif teacher is not None:  # top-k: the teacher renormalised on its k values, the student's full log-probabilities
        idx = teacher["indices"].long().t()  # (k, n)
        log_p = torch.log_softmax(teacher["values"].t().to(z.dtype) / t, dim=0)  # (k, n)
        p = log_p.exp()
        kd_sum = (p * (log_p - log_q.gather(0, idx))).sum()
    if kd_sum is not None:
        kd_sum = (t * t) * kd_sum
    if not want_grad:
        return None, ce_sum, kd_sum
    grad = log_q
    if not made:
        grad.exp_().mul_(q_scale)
        if teacher is not None:  # top-k
            grad.scatter_add_(0, idx, p.mul_(-a))
    if soft1 is not None:
        grad.add_(soft1, alpha=ce_w)
    if ce_w > 0:
        grad.scatter_add_(0, y[None], grad.new_full((1, n), -ce_w))
    return grad, ce_sum, kd_sum


def _one_chunk(hidden, w, head, targets, teacher, s, cdt, temperature, kd_alpha, want_grad):
    """The loss sums of tokens s and, with want_grad, d mean-loss numerator / d raw logits of the chunk (V, n) in
    cdt, with h = hidden[s] in cdt. A function of its own so that each chunk's (V, n) tensors die at its end."""
    h = hidden[s].to(cdt)
    raw = _head_raw(h, w)  # (V, n)
    t_chunk = teacher_chunk(teacher, s) if teacher is not None else None
    grad, ce_sum, kd_sum = _chunk_terms(head.post(raw), targets[s], t_chunk, temperature, kd_alpha, want_grad)
    del t_chunk
    loss_sum = ce_sum if kd_sum is None else kd_sum if kd_alpha == 1.0 else kd_alpha * kd_sum + (1 - kd_alpha) * ce_sum
    if grad is not None:
        grad = head.post_backward(raw, grad).to(cdt)
    return h, grad, torch.stack([loss_sum, ce_sum, kd_sum if kd_sum is not None else ce_sum.new_zeros(())])


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, head, targets, teacher, temperature, kd_alpha, chunk):
        n_tok, dev = hidden.shape[0], hidden.device
        cdt = _compute_dtype(weight)
        acc = float_acc(hidden.dtype if hidden.dtype == torch.float64 else weight.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=dev) if need_w else None
        # loss, ce, kd: sums over tokens (float64; MPS has none)
        sums = torch.zeros(3, dtype=torch.float32 if dev.type == "mps" else torch.float64, device=dev)
        w = weight.to(cdt)
        with _no_autocast(dev):
            for start in range(0, n_tok, chunk or n_tok):
                s = slice(start, start + (chunk or n_tok))
                h, g, chunk_sums = _one_chunk(hidden, w, head, targets, teacher, s, cdt, temperature, kd_alpha,
                                              need_h or need_w)
                sums += chunk_sums.to(sums.dtype)
                if g is None:  # nothing asks for a gradient
                    continue
                g.div_(n_tok)  # (V, n): d mean loss / d raw logits
                if need_h and grad_h.dtype == g.dtype:
                    torch.mm(g.t(), w, out=grad_h[s])
                elif need_h:
                    grad_h[s] = g.t() @ w
                if need_w and g.dtype == acc:
                    grad_w.addmm_(g, h)
                elif need_w:
                    grad_w.add_((g @ h).to(acc))
                del g
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
              temperature: float = 1.0, kd_alpha: float = 1.0,
              chunk: int = CHUNK_TOKENS) -> tuple[Tensor, Tensor, Tensor]:
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
