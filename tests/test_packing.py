"""Packed rows end to end: transformers' packing signal becomes document_ids in converted models, exactly."""
from __future__ import annotations

import pytest
import torch

from covering import covering_pairs, split_cross
from test_hf_common import VOCAB, perturb, tiny

from affine_attention.hf import packing
from affine_attention.train.packing import document_positions, model_inputs
from affine_attention.variants.base import ForwardArgs

LENGTHS = [5, 9, 1, 7]  # a one-token document included; 22 tokens in all


def _docs(seed: int = 0, low: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, VOCAB, (n,), generator=gen) for n in LENGTHS]


def _packed(docs):
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    return ids, pos


# Every family with a variant of each kind it accepts, every variant on >= 3 families (tests/covering.py); the rest
# of the family x variant cross is marked `exhaustive`. Refused pairs are tested in test_hf_families.py.
@pytest.mark.parametrize("family, variant", split_cross(covering_pairs()))
def test_packed_logits_and_gradients_equal_documents_alone(family, variant):
    model = tiny(family, variant)
    perturb(model)
    docs = _docs()
    ids, pos = _packed(docs)
    params = [p for p in model.parameters() if p.requires_grad]

    def ce(logits, tokens):  # next-token loss inside one document, summed
        return torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum")

    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    bounds = torch.tensor([0] + LENGTHS).cumsum(0).tolist()
    loss_p = sum(ce(packed[a:b], ids[0, a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    grads_p = torch.autograd.grad(loss_p, params, allow_unused=True)

    alone = [model(input_ids=d[None], use_cache=False).logits[0] for d in docs]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    loss_a = sum(ce(lg, d) for lg, d in zip(alone, docs))
    grads_a = torch.autograd.grad(loss_a, params, allow_unused=True)
    for (name, _), gp, ga in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], grads_p, grads_a):
        if gp is None or ga is None:
            assert gp is None and ga is None, name
            continue
        torch.testing.assert_close(gp, ga, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_packing_reaches_the_variants_as_document_ids():
    """The seam hands the variant document_ids (and no dense mask); without restarts it leaves the call alone."""
    model = tiny("llama", "affine")
    seen = []
    variant = model.model.layers[0].self_attn.attn_variant
    original = variant.forward

    def spy(*args, **kwargs):
        mask = ForwardArgs.of(args, kwargs).call.mask  # the MaskSpec the seam parsed for this forward
        seen.append((mask.documents, mask.dense if mask.dense is not None else mask.keys))
        return original(*args, **kwargs)

    variant.forward = spy
    ids, pos = _packed(_docs())
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, use_cache=False)
        model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False)
        model(input_ids=ids, position_ids=pos)  # a cache is made: transformers does not treat this as packing
    (docs, mask), (docs2, _), (docs3, _) = seen
    assert mask is None and docs.tolist() == [sum([[i] * n for i, n in enumerate(LENGTHS)], [])]
    assert docs2 is None and docs3 is None


def test_flattening_collator_kwargs():
    """DataCollatorWithFlattening's cu_seq_lens (FlashAttention kwargs) give the same documents as its positions."""
    from transformers import DataCollatorWithFlattening
    from transformers.masking_utils import find_packed_sequence_indices

    features = [{"input_ids": d.tolist()} for d in _docs()]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    T = batch["input_ids"].shape[1]
    from_cu = packing.documents_from_cu_seqlens(batch["cu_seq_lens_k"], T)
    from_pos = find_packed_sequence_indices(batch["position_ids"])  # the rule the packing hook applies
    assert torch.equal(from_cu, from_pos)
    model = tiny("qwen2", "affine")
    with torch.no_grad():
        a = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        b = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **kwargs).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cu_seq_lens_k ends at"):
        packing.documents_from_cu_seqlens(batch["cu_seq_lens_k"], T + 1)


def test_document_positions_restart_after_each_separator():
    x = torch.tensor([[5, 1, 9, 9, 1, 1, 4, 4], [1, 3, 3, 3, 3, 1, 2, 2], [2, 2, 2, 2, 2, 2, 2, 2]])
    assert document_positions(x, 1).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], [0, 0, 1, 2, 3, 4, 0, 1],
                                                 list(range(8))]
    assert set(model_inputs(x, None)) == {"input_ids"}
    kw = model_inputs(x, 1)
    assert kw["use_cache"] is False and torch.equal(kw["position_ids"], document_positions(x, 1))


def test_trainer_with_flattening_collator_matches_padded_run(tmp_path):
    """transformers Trainer + DataCollatorWithFlattening (no padding) gives the padded run's losses."""
    from datasets import Dataset
    from transformers import (DataCollatorForLanguageModeling, DataCollatorWithFlattening, PreTrainedTokenizerFast,
                              Trainer, TrainingArguments)
    from tokenizers import Tokenizer, models

    from affine_attention.hf.callbacks import RunningStatsCallback

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0}, unk_token="<pad>")),
                                  pad_token="<pad>")
    docs = _docs(3, low=1) * 2  # id 0 is the padded run's pad token, never a real one
    data = Dataset.from_list([{"input_ids": d.tolist()} for d in docs])

    def run(collator, batch, name):
        model = tiny("llama", "affine", seed=5).train()
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=batch, max_steps=3,
                                 learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                 use_cpu=True, seed=0, data_seed=0, dataloader_drop_last=False)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                          callbacks=[RunningStatsCallback()])
        trainer.train()
        alpha_ma = torch.cat([b for n, b in model.named_buffers() if n.endswith("alpha_ma")])
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], alpha_ma

    flat, ma_flat = run(DataCollatorWithFlattening(), len(LENGTHS), "flat")
    padded, ma_padded = run(DataCollatorForLanguageModeling(tok, mlm=False), len(LENGTHS), "padded")
    # alpha_ma counts real tokens only: the padded run's padding does not move it.
    assert float(ma_flat.abs().max()) > 0
    # The packed run's mean of V comes from centred prefix sums per document, the padded one's from one cumsum per
    # row: 1e-7 apart in one forward, which 3 steps at lr 1e-2 amplify to a few 1e-6 in alpha_ma.
    torch.testing.assert_close(ma_flat, ma_padded, rtol=1e-4, atol=1e-5)
    # Token-weighted mean over the same real tokens in both; padding is ignored by the padded run's labels.
    assert len(flat) == 3 and flat == pytest.approx(padded, rel=1e-5)
    assert flat[0] != flat[-1]  # it trained


def test_training_with_document_mask(tmp_path):
    """train with data.document_mask = true: the loop feeds restarting positions; losses differ from packing across
    documents on the same short-document data, and the result records the setting."""
    import json

    from test_train_helpers import TINY

    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    data = tmp_path / "docs.jsonl"
    words = "the king and the queen went to see a play in the town of".split()
    data.write_text("".join(json.dumps({"text": " ".join(words[i % 7:i % 7 + 6])}) + "\n" for i in range(200)))
    base = TINY + ["data.train.kind='files'", f"data.train.paths=['{data}']", "data.eval.kind='files'",
                   f"data.eval.paths=['{data}']", f"data.token_cache_dir='{tmp_path / 'tok'}'", "train.steps=2",
                   "variant.name='affine'"]
    runs = {}
    for flag in (True, False):
        cfg = load_config("tiny", base + [f"data.document_mask={str(flag).lower()}"])
        runs[flag] = train(cfg, tmp_path / str(flag), log=lambda m: None)
    assert runs[True]["document_mask"] is True and runs[False]["document_mask"] is False
    assert runs[True]["heldout_loss"] != runs[False]["heldout_loss"]
    first = [json.loads(line) for line in (tmp_path / "True" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("kind") == "train" for r in first)


@pytest.mark.parametrize("variant", ["affine", "sink", "softmax"])
def test_no_t_by_s_tensor_in_a_packed_training_step(variant):
    """T = 2048 with 16 documents per row through a converted model's forward and backward: the largest allocation
    stays far below T x S (the dense block-diagonal mask alone would be T x S)."""
    from test_no_txs import LargestAllocation

    T = 2048
    model = tiny("llama", variant).train()
    lengths = [T // 16] * 16
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with LargestAllocation() as rec:
        out = model(input_ids=ids, position_ids=pos, use_cache=False, labels=ids)
        out.loss.backward()
    assert rec.largest <= T * T // 8, (rec.largest, rec.op)


def test_the_recorder_sees_transformers_dense_packed_mask():
    """Control for the test above: the unconverted model builds a (1, 1, T, T) block-diagonal mask for packed rows."""
    from test_no_txs import LargestAllocation

    T = 2048
    model = tiny("llama").train()
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(T // 16)] * 16)[None]
    with LargestAllocation() as rec:
        model(input_ids=ids, position_ids=pos, use_cache=False, labels=ids).loss.backward()
    assert rec.largest >= T * T
