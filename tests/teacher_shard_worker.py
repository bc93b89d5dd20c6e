"""Run under torchrun (2 gloo processes) by tests/test_teacher_sharded.py: the KD teacher sharded with FSDP2 against
the whole teacher on the same rank's rows, for the full-vocabulary loss and the cached top-k targets (where one rank
finds its rows cached and its peer does not). Writes one JSON file per rank into the folder
named last (stdout lines of two ranks can interleave)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from affine_attention.train.config import KDConfig
from affine_attention.train.distributed import setup
from affine_attention.train.kd import Teacher
from affine_attention.train.kd_chunked import OutputHead, head_loss
from affine_attention.train.pretrained import load_tokenizer


def _teacher(folder: str, tok, shard: bool, **kw) -> Teacher:
    cfg = KDConfig(enabled=True, teacher=folder, teacher_dtype="float32", **kw)
    return Teacher(cfg, student_tok=tok, student_tok_spec="default", student_vocab=4096, data_key="d", seq_len=12,
                   device=torch.device("cpu"), rank=info.rank, chunk=5, shard=shard)


def _local_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


if __name__ == "__main__":
    folder, cache_dir = sys.argv[1], sys.argv[2]
    info = setup("cpu")
    tok = load_tokenizer("default")
    g = torch.Generator().manual_seed(10 + info.rank)  # each rank its own rows, as in training
    inputs = torch.randint(0, 4096, (3, 12), generator=g)
    ids = torch.arange(3) + 100 * info.rank
    hidden = torch.randn(3, 12, 8, generator=g)
    head = OutputHead(torch.randn(4096, 8, generator=g))
    targets = torch.randint(0, 4096, (3, 12), generator=g)
    out = {"rank": info.rank}
    # Full-vocabulary KD at T = 2 mixed with CE: the loss and its gradient to the student's hidden states.
    for name, shard in (("whole", False), ("sharded", True)):
        teacher = _teacher(folder, tok, shard)
        h = hidden.clone().requires_grad_()
        t = teacher.targets(inputs, ids)
        loss, ce, kd = head_loss(h, head, targets, teacher=t, temperature=2.0, kd_alpha=0.7, chunk=5)
        teacher.release()
        loss.backward()
        out[name] = {"loss": loss.item(), "kd": kd.item(), "grad": h.grad.flatten().tolist(),
                     "param_bytes": _local_bytes(teacher.model)}
        # After release no full tensor of the teacher is left: every parameter is this rank's shard again.
        out[name]["all_sharded"] = all(hasattr(p, "to_local") for p in teacher.model.parameters())
    # Top-k through the cache: both ranks miss, then rank 0 finds its rows cached while rank 1 misses new ones.
    whole = _teacher(folder, tok, False, top_k=4)
    sharded = _teacher(folder, tok, True, top_k=4, cache=True, cache_dir=cache_dir, cache_shard_sequences=2)
    first = sharded.targets(inputs, ids)
    again_ids = ids if info.rank == 0 else ids + 50
    again_inputs = inputs if info.rank == 0 else inputs.flip(0)
    second = sharded.targets(again_inputs, again_ids)
    want_first, want_second = whole.targets(inputs, ids), whole.targets(again_inputs, again_ids)
    out["topk_diff"] = max(float((a[k].double() - b[k].double()).abs().max())
                           for a, b in ((first, want_first), (second, want_second)) for k in ("values", "indices"))
    Path(sys.argv[3], f"rank{info.rank}.json").write_text(json.dumps(out))
