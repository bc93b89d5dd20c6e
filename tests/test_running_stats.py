"""alpha_ma is stepped from outside the model, once per optimizer step: layout invariance in one process (micro-batches,
activation checkpointing), the loud warning when nobody steps, the transformers Trainer callback against the package's
own training loop, and the accumulator's place in checkpoints and DDP."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from stats_layout import alpha_ma, model, train
from test_hf_common import left_padded, tiny

import affine_attention
from affine_attention.variants import running_stats


@pytest.mark.parametrize("micro, checkpointing, reentrant", [(4, False, False), (4, True, False), (2, True, True)])
def test_micro_batches_and_checkpointing_give_the_one_batch_alpha_ma(micro, checkpointing, reentrant):
    ref = alpha_ma(train(micro=1))
    got = alpha_ma(train(micro=micro, checkpointing=checkpointing, reentrant=reentrant))
    assert (got - ref).abs().max() <= 1e-6
    assert (ref - ref.mean()).abs().max() > 1e-3


def test_one_step_is_the_token_weighted_mean_over_micro_batches():
    m = model()
    before = alpha_ma(m)
    ids, mask, pos = left_padded(B=3, T=10)
    with torch.no_grad():
        for b in range(3):  # one row per micro-batch, of different real lengths
            m(ids[b:b + 1], attention_mask=mask[b:b + 1], position_ids=pos[b:b + 1])
        # layer 0's input is the normalised embedding, so its alpha can be recomputed here exactly
        layer = m.model.layers[0]
        a = layer.self_attn.attn_variant.compute_alpha(layer.input_layernorm(m.model.embed_tokens(ids)))  # (B, H, T)
        w = mask.bool()[:, None, :]
        mean = (a * w).sum((0, 2)) / w.sum()
    assert torch.equal(alpha_ma(m), before), "forward must not change alpha_ma"
    assert affine_attention.step_running_stats(m) == len(m.model.layers)
    torch.testing.assert_close(alpha_ma(m)[0], 0.9 * before[0] + 0.1 * mean.double(), rtol=0, atol=1e-6)
    assert all(not layer.self_attn.attn_variant.alpha_acc.any() for layer in m.model.layers)
    stepped = alpha_ma(m)
    affine_attention.step_running_stats(m)  # nothing accumulated since: alpha_ma stays
    assert torch.equal(alpha_ma(m), stepped)


def test_training_without_stepping_warns_once(monkeypatch):
    monkeypatch.setattr(running_stats, "_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(micro=1, step=None)
        train(micro=1, step=None)
    ours = [w for w in caught if issubclass(w.category, running_stats.RunningStatsWarning)]
    assert len(ours) == 1 and "step_running_stats" in str(ours[0].message)
    monkeypatch.setattr(running_stats, "_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(micro=2)
    assert not [w for w in caught if issubclass(w.category, running_stats.RunningStatsWarning)]


def test_a_meta_model_in_training_mode_does_not_break_another_models_optimizer_step(monkeypatch):
    """A converted model on the meta device (a dry run's) stays watched while alive; another model's optimizer step
    must neither read its counts (there are none) nor lose the warning for the model that trains unstepped."""
    from test_train_helpers import TINY

    from affine_attention.train.config_load import load_config
    from affine_attention.train.model import base_model, convert

    monkeypatch.setattr(running_stats, "_WARNED", False)
    cfg = load_config("tiny", TINY)
    idle = convert(base_model(cfg, 0, meta=True), "affine").train()  # as the dry run builds its models
    assert next(idle.parameters()).is_meta
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(micro=1, step=None)
        train(micro=1, step=None)
    assert len([w for w in caught if issubclass(w.category, running_stats.RunningStatsWarning)]) == 1
    assert idle.training


@pytest.mark.parametrize("stepped", [True, False])
def test_two_optimizers_per_iteration_warn_only_when_never_stepped(stepped, monkeypatch):
    monkeypatch.setattr(running_stats, "_WARNED", False)
    m = model()
    params = list(m.parameters())
    optimizers = [torch.optim.SGD(params[::2], lr=0.1), torch.optim.SGD(params[1::2], lr=0.1)]
    ids, mask, pos = left_padded(T=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            m(ids, attention_mask=mask, position_ids=pos, labels=ids).loss.backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            if stepped:
                affine_attention.step_running_stats(m)
    ours = [w for w in caught if issubclass(w.category, running_stats.RunningStatsWarning)]
    assert len(ours) == (0 if stepped else 1)


def test_step_arguments_and_models_without_statistics():
    assert affine_attention.step_running_stats(tiny("llama", "sink")) == 0
    with pytest.raises(ValueError, match="group was given but torch.distributed is not initialised"):
        affine_attention.step_running_stats(tiny("llama", "affine"), group=object())


def test_accumulator_is_saved_kept_local_under_ddp_and_untouched_by_dtype_casts(tmp_path):
    from transformers import AutoModelForCausalLM

    m = tiny("llama", "affine_gated")
    key = "model.layers.0.self_attn.attn_variant.alpha_acc"
    assert key in m.state_dict() and key in m._ddp_params_and_buffers_to_ignore
    m.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # materialised from the meta device
    assert not loaded.state_dict()[key].any() and key in loaded._ddp_params_and_buffers_to_ignore
    assert loaded.to(torch.bfloat16).state_dict()[key].dtype == torch.int64


def test_trainer_callback_and_package_loop_agree(tmp_path):
    """Same data, optimizer, schedule and micro-batches: the Trainer with RunningStatsCallback ends with the loop's
    alpha_ma (3 steps of 2 micro-batches; W_alpha moves, so alpha depends on the data)."""
    from test_train_helpers import tiny_overrides
    from transformers import Trainer, TrainingArguments

    from affine_attention.hf.callbacks import RunningStatsCallback
    from affine_attention.train.config_load import load_config
    from affine_attention.train.data import TrainBatches, open_source
    from affine_attention.train.kd import ce_loss
    from affine_attention.train.loop import train as package_train
    from affine_attention.train.model import build_base, convert
    from affine_attention.train.optim import build_optimizer, lr_factor
    from affine_attention.train.pretrained import load_tokenizer

    steps = 3
    cfg = load_config("tiny", tiny_overrides(tmp_path) + [
        f"train.steps={steps}", "train.global_batch=4", "train.micro_batch=2", "variant.name='affine'",
        "train.threads=0", "optim.lr=0.05"])
    package_train(cfg, tmp_path / "run", log=lambda *a, **k: None)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    want = torch.tensor([r for r in evals if r.get("kind") == "eval"][-1]["alpha_ma"], dtype=torch.float64)

    tok = load_tokenizer(cfg.data.tokenizer)
    source = open_source(cfg.data.train, tok, cfg.data, cfg.train.seed, shuffle=cfg.data.shuffle)
    batches = TrainBatches(source, 4, 4, 0, 1)
    rows = torch.cat([batches.next()[0] for _ in range(steps)])  # the loop's rows, in its order
    base = build_base(cfg.model, cfg.train.seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    hf = convert(base, "affine", cfg.variant.options, copy_model=False).train()
    opt = build_optimizer(hf, cfg.optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, cfg.schedule))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i, :-1], "labels": rows[i, 1:]}

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=steps, max_grad_norm=cfg.optim.clip_grad_norm,
                             train_sampling_strategy="sequential", report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(hf, args, train_dataset=Rows(), optimizers=(opt, sched), callbacks=[RunningStatsCallback()],
                      compute_loss_func=lambda out, labels, num_items_in_batch=None: ce_loss(out.logits, labels) / 2)
    trainer.train()
    got = alpha_ma(hf)
    # 1e-5: the package loop's CE is computed in chunks from the final hidden states (train/kd_chunked.py), the
    # Trainer's from whole logits; float32 rounding, grown by lr 0.05 over 3 steps (seen: 1.6e-6; signal: 8e-3)
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()
    assert (got - (1 - 0.9 ** steps) * 0.5).abs().max() > 1e-5  # not the value of a constant alpha = 0.5
