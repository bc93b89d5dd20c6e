"""Token-level perplexity of a causal LM on raw text (the paper's C4-style number), with
non-overlapping windows or the standard sliding-window method.

Which tokens count
------------------
The documents are tokenised without special tokens and joined into one stream, each document
preceded by the tokenizer's eos token (the packed-training layout: eos is also the separator)::

    eos d1_1 .. d1_n eos d2_1 .. d2_m ...

Every token of the stream except the very first eos is a target exactly once, predicted from the
tokens before it inside its window: all document tokens are scored, plus the eos between two
documents (predicting "this document ends here"). Windows of ``seq_len`` tokens start at
``0, stride, 2*stride, ...`` until one reaches the end of the stream:

- ``stride=None`` (= ``seq_len``): non-overlapping windows. The first token of each window has no
  context inside it, so it is only context: windows after the first score ``seq_len - 1`` tokens,
  and those first tokens are never scored.
- ``stride < seq_len``: each window scores only the tokens no earlier window scored (its last
  ``stride`` tokens, after the first window), so each of them sees at least ``seq_len - stride``
  tokens of context. Every token but the first is scored.

``loss`` is the mean negative log-likelihood per scored token (nats), ``ppl = exp(loss)``,
``tokens`` the number of scored tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..text import encode_documents


def read_texts(texts: Any, text_column: str = "text") -> list[str]:
    """Documents from a path, a ``datasets`` split or an iterable of str (see `affine_attention.text.read_documents`)."""
    from ..text import read_documents

    return read_documents(texts, text_column)


def _windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` per window over a stream of ``n_tokens``: the window is
    ``stream[begin:end]``, the scored targets are ``stream[first_scored:end]``."""
    windows = []
    begin, prev_end = 0, 0
    while True:
        end = min(begin + seq_len, n_tokens)
        first = max(prev_end, begin + 1)  # a window's first token has nothing before it to predict it
        if first < end:
            windows.append((begin, end, first))
        if end == n_tokens:
            return windows
        prev_end = end
        begin += stride


def perplexity(
    model,
    tokenizer,
    texts: Iterable[str] | str | Path | Any,
    *,
    seq_len: int = 1024,
    stride: int | None = None,
    batch_size: int = 4,
    device: str | None = None,
    text_column: str = "text",
) -> dict:
    """Perplexity of ``model`` on ``texts`` (see the module docstring for exactly which tokens count).

    Args:
        model: a transformers causal LM (anything returning ``.logits`` of shape (B, T, vocab)).
        tokenizer: its tokenizer; must define ``eos_token_id`` (the document separator).
        texts: iterable of documents, a ``.txt`` / ``.jsonl`` path, or a ``datasets.Dataset`` split.
            Empty documents are skipped (they hold no tokens to score).
        seq_len: window length in tokens (at most the model's ``max_position_embeddings``).
        stride: window step; ``None`` means ``seq_len`` (non-overlapping).
        batch_size: windows per forward pass.
        device: run there, moving the model in place; ``None`` keeps the model where it is.
        text_column: the text field for ``.jsonl`` files and datasets.

    Returns:
        ``{"loss", "ppl", "tokens", "documents", "windows", "seq_len", "stride"}``. Runs in eval mode
        without gradients (the previous train/eval mode is restored); deterministic for a given model.
    """
    import torch
    import torch.nn.functional as F

    stride = seq_len if stride is None else stride
    for name, value in (("seq_len", seq_len), ("stride", stride), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (one context token and one target), got {seq_len}")
    if stride > seq_len:
        raise ValueError(
            f"stride ({stride}) must not exceed seq_len ({seq_len}): tokens in between would never be scored"
        )
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(max_positions, int) and seq_len > max_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_position_embeddings ({max_positions})")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; it is needed to separate documents")

    docs = [doc for doc in read_texts(texts, text_column) if doc]
    if not docs:
        raise ValueError("no non-empty documents to score")
    encoded = encode_documents(tokenizer, docs)  # a special token's string in a document stays text
    stream: list[int] = []
    for ids in encoded:
        stream.append(eos)
        stream.extend(ids)
    windows = _windows(len(stream), seq_len, stride)
    if not windows:
        raise ValueError("the texts tokenise to a single token: nothing to score")

    if device is not None:
        model.to(device)
    run_device = next(model.parameters()).device
    tokens = torch.tensor(stream, dtype=torch.long)
    total_nll = 0.0  # float64 accumulation: windows of float32 sums can be large
    total_tokens = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                batch = windows[start : start + batch_size]
                width = max(end - begin for begin, end, _ in batch)
                input_ids = torch.full((len(batch), width), eos, dtype=torch.long)
                attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, (begin, end, _) in enumerate(batch):
                    input_ids[row, : end - begin] = tokens[begin:end]
                    attention_mask[row, : end - begin] = 1
                # Right padding never changes the logits of real positions under a causal mask; pass
                # the mask only when there is padding, so unpadded batches keep the kernels' causal path.
                kwargs = {"attention_mask": attention_mask.to(run_device)} if not bool(attention_mask.all()) else {}
                logits = model(input_ids=input_ids.to(run_device), use_cache=False, **kwargs).logits
                for row, (begin, end, first) in enumerate(batch):
                    # Logit at window position p predicts the token at p + 1.
                    pred = logits[row, first - begin - 1 : end - begin - 1].float()
                    target = tokens[first:end].to(run_device)
                    total_nll += F.cross_entropy(pred, target, reduction="sum").item()
                    total_tokens += end - first
    finally:
        model.train(was_training)

    loss = total_nll / total_tokens
    return {
        "loss": loss,
        "ppl": math.exp(loss) if loss < 700 else math.inf,  # exp overflows a float past ~709
        "tokens": total_tokens,
        "documents": len(docs),
        "windows": len(windows),
        "seq_len": seq_len,
        "stride": stride,
    }
