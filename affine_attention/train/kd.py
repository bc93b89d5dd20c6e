"""Knowledge distillation: forward KL(teacher || student) with temperature, a live or cached teacher, vocab checks.

Loss = kd_alpha * T^2 * KL(softmax(z_t / T) || softmax(z_s / T)) + (1 - kd_alpha) * CE(z_s, targets), averaged over
tokens. T^2 keeps the gradient scale independent of T (Hinton et al. 2015).

Top-k approximation (kd.top_k = k > 0): only the teacher's k largest logits per token are used (and cached). The
teacher distribution is renormalised on that support, p~_j = softmax_j(v_j / T) over the k kept values, and the
student keeps its full-vocabulary log-probabilities: KL~ = sum_{j in top-k} p~_j (log p~_j - log q_j). This is exact
when the teacher puts no mass outside its top k; otherwise it drops the tail's contribution and slightly
over-weights the head. KL~ >= 0, and it is 0 only when the student matches p~ exactly on the support.
The cached and the live teacher give identical values for the same k (the cache stores the teacher's own dtype).

These full-logits functions are the reference; training computes the same loss in token chunks (kd_chunked.py).
The live teacher runs under torch.no_grad without a KV cache and hands over its final hidden states, so its logits
are made chunk by chunk too. Under torchrun it is sharded with FSDP2 across the ranks (distributed.shard_frozen, in
teacher_dtype, no gradients or optimizer state): a rank holds 1/world of its layers instead of a full copy.
"""
from __future__ import annotations

import hashlib
import json

import torch
import torch.nn.functional as F
from torch import Tensor

from .._compat import float_acc
from .config import KDConfig
from .kd_chunked import CHUNK_TOKENS, final_hidden, output_head, topk_chunked
from .packing import model_inputs
from .pretrained import load_causal_lm, load_tokenizer, resolve, teacher_identity


def _acc(x: Tensor) -> Tensor:
    """x in float32, or float64 when it is float64 (the float64 tests of the chunked loss compare against these)."""
    return x.to(float_acc(x.dtype))


def kd_loss_full(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """T^2 * mean over tokens of KL(p_t || q_s). student_logits, teacher_logits: (..., V). float32 (float64) scalar."""
    t = temperature
    log_q = F.log_softmax(_acc(student_logits) / t, dim=-1).flatten(0, -2)
    log_p = F.log_softmax(_acc(teacher_logits) / t, dim=-1).flatten(0, -2)
    return (t * t) * F.kl_div(log_q, log_p, log_target=True, reduction="sum") / log_q.shape[0]


def kd_loss_topk(student_logits: Tensor, values: Tensor, indices: Tensor, temperature: float) -> Tensor:
    """Top-k KD (module docstring). student_logits: (..., V); values, indices: (..., k) teacher logits and ids."""
    t = temperature
    log_q = F.log_softmax(_acc(student_logits) / t, dim=-1).gather(-1, indices.long())  # (..., k)
    log_p = F.log_softmax(_acc(values) / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (t * t) * kl.mean()


def ce_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) int64."""
    return F.cross_entropy(_acc(logits).flatten(0, 1), targets.flatten())


def vocab_fingerprint(tok) -> tuple[str, int]:
    """(sha256 of the token -> id map, its size): equal maps mean equal vocabularies."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest(), len(vocab)


def check_vocab(teacher_spec: str, teacher_fp: tuple[str, int], teacher_dim: int, student_spec: str,
                student_fp: tuple[str, int], student_dim: int) -> None:
    """Refuse a teacher whose tokenizer or output size differs from the student's, saying how to fix it."""
    if teacher_fp[0] != student_fp[0]:
        raise ValueError(
            f"the KD teacher's vocabulary differs from the student's: teacher {teacher_spec!r} has a "
            f"{teacher_fp[1]}-token vocabulary, the student's tokenizer {student_spec!r} a different "
            f"{student_fp[1]}-token one. KD compares the two distributions token by token, so both must share one "
            f"tokenizer: set data.tokenizer = {teacher_spec!r} and model.vocab_size = {teacher_dim}")
    if teacher_dim != student_dim:
        raise ValueError(f"the KD teacher outputs {teacher_dim} logits per token but the student {student_dim}; "
                         f"set model.vocab_size = {teacher_dim}")


def teacher_dtype(cfg: KDConfig, device: torch.device) -> torch.dtype:
    if cfg.teacher_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.teacher_dtype]


def _any_rank(mine: bool, device: torch.device) -> bool:
    """Whether any rank says True (collective)."""
    import torch.distributed as dist

    flag = torch.tensor([int(mine)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def check_finite_teacher(model, spec: str) -> None:
    """A teacher whose weights hold nan or inf makes every KD loss non-finite, which training would report as a
    divergence of the student (lower optim.lr): refuse it here, naming it and its first such weight. One host sync,
    once per loaded teacher (before it is sharded: every weight is whole here)."""
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    if not params or bool(torch.stack([torch.isfinite(p).all() for _, p in params]).all()):
        return
    name, p = next((n, p) for n, p in params if not bool(torch.isfinite(p).all()))
    bad = int((~torch.isfinite(p)).sum())
    raise ValueError(f"KD teacher {spec!r} has non-finite weights ({bad} nan/inf values in {name}, "
                     f"{tuple(p.shape)}); every KD loss would be nan: repair or re-download the teacher's weights, "
                     "or load it in a dtype that holds them (kd.teacher_dtype)")


class Teacher:
    """Teacher targets for a micro-batch: live forwards, or the on-disk top-k cache filled on first use.

    The model is loaded only when some sequence is not cached, so a run on fully cached data never loads it.
    """

    def __init__(self, cfg: KDConfig, *, student_tok, student_tok_spec: str, student_vocab: int, data_key: str,
                 seq_len: int, device: torch.device, rank: int = 0, doc_sep: int | None = None,
                 chunk: int = CHUNK_TOKENS, compile: bool = False, shard: bool = False):
        # doc_sep: the separator id under document masking; the teacher then sees the student's document boundaries.
        # shard: the run is distributed, so the teacher is sharded across its ranks (every rank calls `targets`
        # for every micro-batch: its forwards are collective).
        self.cfg, self.device, self.rank, self.doc_sep, self.shard = cfg, device, rank, doc_sep, shard
        self.chunk = chunk  # tokens per chunk of the live top-k (train.loss_chunk_tokens)
        self.compile = compile  # compile its decoder blocks as the student's (train.compile)
        self.dtype = teacher_dtype(cfg, device)
        self._model = None
        self.cache = None
        self.keep, self.memo = 0, {}  # `share`
        self.forward_tokens = 0  # tokens this process's teacher forwarded since `take_forward_tokens` (MFU)
        student_fp = vocab_fingerprint(student_tok)
        meta = None
        if cfg.cache:
            from .teacher_cache import TeacherCache

            key = {"format": 1, "data": data_key, "seq_len": seq_len, "teacher": teacher_identity(cfg.teacher),
                   "top_k": cfg.top_k, "dtype": str(self.dtype),
                   **({"document_mask": True} if doc_sep is not None else {})}  # old caches keep their key
            self.cache = TeacherCache(cfg.cache_dir, key, shard_sequences=cfg.cache_shard_sequences, rank=rank)
            meta = self.cache.teacher_meta()
        if meta is None:  # read the teacher's tokenizer and output size (config only, no weights)
            from transformers import AutoConfig

            t_tok = student_tok if cfg.teacher == student_tok_spec else load_tokenizer(cfg.teacher)
            path, kwargs = resolve(cfg.teacher)
            t_cfg = AutoConfig.from_pretrained(path, **kwargs)
            fp = vocab_fingerprint(t_tok)
            meta = {"vocab_sha256": fp[0], "vocab_size": fp[1], "logits_dim": int(t_cfg.get_text_config().vocab_size)}
            if self.cache is not None:
                self.cache.set_teacher_meta(meta)
        check_vocab(cfg.teacher, (meta["vocab_sha256"], meta["vocab_size"]), meta["logits_dim"], student_tok_spec,
                    student_fp, student_vocab)
        if cfg.top_k > meta["logits_dim"]:
            raise ValueError(f"kd.top_k = {cfg.top_k} is more than the {meta['logits_dim']} logits teacher "
                             f"{cfg.teacher!r} makes per token; set kd.top_k to at most {meta['logits_dim']}, or to 0 "
                             "for the full-vocabulary KL")

    @property
    def model(self):
        if self._model is None:
            self._model = load_causal_lm(self.cfg.teacher, self.dtype, self.device)
            check_finite_teacher(self._model, self.cfg.teacher)
            if self.compile:
                from .blocks import compile_blocks

                compile_blocks(self._model)
            if self.shard:
                from .distributed import shard_frozen

                shard_frozen(self._model)
        return self._model

    def release(self) -> None:
        """After the loss has read the teacher's head: a sharded teacher frees its gathered root (embeddings, head)."""
        if self.shard and self._model is not None:
            self._model.reshard()

    @torch.no_grad()
    def _forward(self, inputs: Tensor) -> dict[str, Tensor]:
        """The teacher's final hidden states and head ({"hidden", "head"}: logits are made chunk by chunk in the
        loss), or its top k logits per token, made chunk by chunk here. Never a KV cache: one forward per batch."""
        model_kwargs = {**model_inputs(inputs.to(self.device), self.doc_sep), "use_cache": False}
        self.forward_tokens += inputs.numel()
        hidden = final_hidden(self.model, model_kwargs)  # (B, T, Ht)
        if self.shard:  # the root reshards after a forward without grad: gather the head once more for the loss
            self.model.unshard()
        head = output_head(self.model)
        if self.cfg.top_k == 0:
            return {"hidden": hidden, "head": head}  # `release` after the loss
        top = topk_chunked(hidden, head, self.cfg.top_k, self.chunk)
        self.release()
        return top

    def targets(self, inputs: Tensor, ids: Tensor) -> dict[str, Tensor]:
        """inputs: (B, T) int64, ids: (B,) sequence ids -> {"hidden": (B, T, Ht), "head": OutputHead} (full KD) or
        {"values", "indices": (B, T, k)} (top-k), as `kd_chunked.head_loss` takes them."""
        if self.cache is None:
            return self._shared(inputs, ids) if self.keep else self._forward(inputs)
        found = self.cache.get(ids.tolist())
        missing = [i for i, row in enumerate(found) if row is None]
        if self.shard and not missing and _any_rank(False, self.device):
            self._forward(inputs[:1])  # a peer's forward is collective: join it, the result is not needed here
        elif missing and (not self.shard or _any_rank(True, self.device)):
            fresh = self._forward(inputs[missing])
            self.cache.put(ids[missing].tolist(), fresh["values"].cpu(), fresh["indices"].cpu())
            for j, i in enumerate(missing):
                found[i] = (fresh["values"][j].cpu(), fresh["indices"][j].cpu())
        values = torch.stack([v for v, _ in found]).to(self.device)
        indices = torch.stack([x for _, x in found]).to(self.device)
        return {"values": values, "indices": indices}

    def take_forward_tokens(self) -> int:
        """The tokens forwarded since the last call, which restarts the count: a step's cost takes them after the
        step, so a forward shared by runs in lockstep (`share`) or answered by the cache is charged to no run but the
        one whose step ran it."""
        n, self.forward_tokens = self.forward_tokens, 0
        return n

    def share(self, micro_batches: int) -> None:
        """Keep the live targets of the last `micro_batches` micro-batches, so runs stepped in lockstep on the same
        data (compare's variants) share one teacher forward per micro-batch. Holds that many (b, T, Ht) hidden
        states (or top-k rows); a sharded teacher gathers its root again for each run that reads them."""
        self.keep = micro_batches

    def _shared(self, inputs: Tensor, ids: Tensor) -> dict[str, Tensor]:
        key = tuple(ids.tolist())
        kept = self.memo.get(key)
        if kept is not None and torch.equal(kept[0], inputs):
            out = dict(kept[1])
            if "hidden" in out:
                if self.shard:  # every rank hits here together: its peers step the same runs in the same order
                    self.model.unshard()
                out["head"] = output_head(self.model)
            return out
        out = self._forward(inputs)
        self.memo[key] = (inputs.clone(), {k: v for k, v in out.items() if k != "head"})
        while len(self.memo) > self.keep:
            self.memo.pop(next(iter(self.memo)))
        return out

    def flush(self) -> None:
        if self.cache is not None:
            self.cache.flush()
