"""What users combine a converted model with, driven for real: generate with a tokenizer (stop strings), trl's
SFTTrainer with packing (padding-free: seq_idx and cu_seq_lens), and the seam's keyword rule behind them."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from test_hf_common import perturb, tiny

import affine_attention
from affine_attention.hf import packing
from affine_attention.hf.attention import unclassified_kwargs
from affine_attention.text.corpus import corpus_texts, default_tokenizer

LENGTHS = [5, 9, 1, 7]


def test_every_keyword_transformers_declares_is_classified():
    """TransformersKwargs, FlashAttentionKwargs and generate()'s own keywords of the installed transformers: each is
    honoured or known inert, so none is refused the first time a user's tool passes it."""
    assert unclassified_kwargs() == []


def _converted_pair(seed: int = 3, **overrides):
    """(unconverted, converted with function_preserving=True) tiny Llamas of the same weights."""
    base = tiny("llama", seed=seed, **overrides)
    return base, affine_attention.convert(copy.deepcopy(base), "affine", function_preserving=True)


def test_generate_with_tokenizer_and_stop_strings_matches_unconverted():
    tok = default_tokenizer()
    base, converted = _converted_pair(vocab_size=len(tok))
    ids = tok(["To be, or not to be, that is", "Friends, Romans, countrymen"], return_tensors="pt",
              padding=True, padding_side="left")
    runs = [m.generate(**ids, max_new_tokens=12, do_sample=False, tokenizer=tok, stop_strings=["the"],
                       pad_token_id=tok.pad_token_id) for m in (base, converted)]
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


def test_output_hidden_states_is_inert_and_refusals_name_their_reason():
    base, converted = _converted_pair()
    ids = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        ref, out = base(ids, output_hidden_states=True), converted(ids, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states)
    torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="never materialise attention weights"):
        converted(ids, output_attentions=True)
    with pytest.raises(ValueError, match="bidirectional"):
        converted(ids, is_causal=False)
    with pytest.raises(ValueError, match=r"\['not_a_keyword'\]"):
        converted(ids, not_a_keyword=1)


def _docs(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen) for n in LENGTHS]


def test_seq_idx_alone_carries_the_documents_exactly():
    """seq_idx is honoured as document ids even where positions never restart (a collator that numbers positions
    along the whole row): the packed row's logits equal each document run alone."""
    model = tiny("llama", "affine", seed=4)
    perturb(model)
    docs = _docs()
    seq_idx = torch.cat([torch.full((len(d),), i, dtype=torch.int32) for i, d in enumerate(docs)])[None]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=pos, seq_idx=seq_idx, use_cache=False).logits[0]
        alone = torch.cat([model(d[None], use_cache=False).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    # Beside an attention mask the packing hook does not act: the boundaries would be dropped, so they are refused.
    with pytest.raises(ValueError, match="packed sequence boundaries"):
        model(ids, attention_mask=torch.ones_like(ids), seq_idx=seq_idx, use_cache=False)
    with pytest.raises(ValueError, match="describe different packed documents"):
        model(ids, position_ids=pos, seq_idx=torch.zeros_like(seq_idx), use_cache=False,
              cu_seq_lens_k=torch.tensor([0, 5, 14, 15, 22], dtype=torch.int32))


def test_trl_sft_trainer_with_packing_matches_unconverted(tmp_path):
    """trl's SFTTrainer with packing=True (best-fit packing, padding-free: the batch carries position_ids,
    cu_seq_lens and seq_idx and no attention mask) trains the converted model; its first loss, before any update,
    equals the unconverted model's on the same packed batch."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from affine_attention.hf.callbacks import RunningStatsCallback

    tok = default_tokenizer()
    base, converted = _converted_pair(seed=6, vocab_size=len(tok))
    lines = [line for line in corpus_texts("train")[0].splitlines() if len(line.split()) > 3][:24]
    data = Dataset.from_list([{"text": line} for line in lines])
    seen = []

    def losses(model, name):
        args = trl.SFTConfig(output_dir=str(tmp_path / name), packing=True, max_length=64,
                             per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0)
        trainer = trl.SFTTrainer(model=model.train(), args=args, train_dataset=data, processing_class=tok,
                                 callbacks=[RunningStatsCallback()])
        hook = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(set(kw)), with_kwargs=True)
        trainer.train()
        hook.remove()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ref, out = losses(base, "base"), losses(converted, "converted")
    # seen after the packing hook: trl's padding-free keys arrived and became document ids
    assert {"seq_idx", "cu_seq_lens_k", "position_ids", "attention_mask"} <= seen[-1]
    assert len(out) == 2 and out[0] == pytest.approx(ref[0], rel=1e-5)
    alpha_ma = torch.cat([b for n, b in converted.named_buffers() if n.endswith("alpha_ma")])
    assert float(alpha_ma.abs().max()) > 0  # stepped by the callback


def test_trl_bf16_on_cpu_is_named_and_bf16_false_reloads_exactly(tmp_path):
    """trl's SFTConfig defaults to bf16=True, also on CPU: accelerate then leaves the trained model's forward wrapped
    in torch.autocast, so it differs from its own reloaded checkpoint (the trap, which looks like a save bug). The
    callback names it at train time; with bf16=False the reload gives the same logits exactly."""
    trl = pytest.importorskip("trl")
    import warnings

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from affine_attention.hf.callbacks import CpuAutocastWarning, RunningStatsCallback

    tok = default_tokenizer()
    lines = [line for line in corpus_texts("train")[0].splitlines() if len(line.split()) > 3][:8]
    data = Dataset.from_list([{"text": line} for line in lines])
    ids = torch.tensor([tok("To be or not to be, that is the question").input_ids])

    def train_and_reload(name, **config):
        model = _converted_pair(seed=6, vocab_size=len(tok))[1]
        args = trl.SFTConfig(output_dir=str(tmp_path / name), max_length=32, per_device_train_batch_size=2,
                             max_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, **config)
        trainer = trl.SFTTrainer(model=model.train(), args=args, train_dataset=data, processing_class=tok,
                                 callbacks=[RunningStatsCallback()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        model.eval().save_pretrained(tmp_path / name / "final")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / name / "final").eval()
        with torch.no_grad():
            gap = float((model(ids).logits.float() - again(ids).logits).abs().max())
        return [w for w in caught if issubclass(w.category, CpuAutocastWarning)], gap

    named, gap = train_and_reload("default")  # SFTConfig's own default: bf16=True
    assert len(named) == 1 and "bf16=False" in str(named[0].message), [str(w.message) for w in named]
    assert gap > 1e-4  # the trap is real: the in-memory model still runs under autocast
    named, gap = train_and_reload("fp32", bf16=False)
    assert named == [] and gap == 0.0


def test_readme_peft_import_registers_without_a_warning():
    """`from affine_attention import peft_config` is the package's first transformers import on the README's PEFT
    path: it must register the converted model types quietly (it once warned they would not load, yet they did)."""
    code = ("import warnings; warnings.simplefilter('error', RuntimeWarning)\n"
            "from affine_attention import peft_config\n"
            "from transformers import AutoConfig\n"
            "print(type(AutoConfig.for_model('affine_llama')).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "will not load" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip().endswith("Config")


def test_continuous_batching_and_an_overwritten_implementation_are_refused():
    """transformers' continuous batching would serve plain softmax (its paged kernels); so would a converted model
    whose private config._attn_implementation was overwritten. Both are refused, never served."""
    from transformers import GenerationConfig

    model = tiny("llama", "affine", seed=1)
    ids = torch.randint(3, 128, (1, 6))
    with pytest.raises(ValueError, match="vLLM"):
        model.generate_batch(inputs=[ids[0].tolist()], generation_config=GenerationConfig(max_new_tokens=2))
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="would compute plain softmax"):
        model(ids)
    model.config._attn_implementation = "affine_attention"
    model(ids)


def _trl_run(trainer_cls, config_cls, model, tmp_path, data, **kw):
    """Log records of a short trl run on CPU (seeded, nothing saved)."""
    from affine_attention.hf.callbacks import RunningStatsCallback

    cfg = {k: kw.pop(k) for k in list(kw) if k in config_cls.__dataclass_fields__}
    args = config_cls(output_dir=str(tmp_path), max_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                      use_cpu=True, seed=0, data_seed=0, learning_rate=1e-3, **cfg)
    trainer = trainer_cls(model=model.train(), args=args, train_dataset=data, processing_class=default_tokenizer(),
                          callbacks=[RunningStatsCallback()], **kw)
    trainer.train()
    return next(h for h in trainer.state.log_history if "loss" in h)


def test_trl_dpo_and_grpo_match_unconverted(tmp_path):
    """trl's DPO (fused LM head over the concatenated pairs) and GRPO (its own sampling, then the policy loss): the
    function-preserving conversion gives the unconverted model's log-probabilities, rewards and entropy."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok = default_tokenizer()
    base, converted = _converted_pair(seed=6, vocab_size=len(tok))
    pairs = Dataset.from_list([{"prompt": "To be or not", "chosen": " to be", "rejected": " a fish"}] * 4)
    dpo = [_trl_run(trl.DPOTrainer, trl.DPOConfig, m, tmp_path / f"dpo{i}", pairs, per_device_train_batch_size=2,
                    ref_model=copy.deepcopy(m).eval()) for i, m in enumerate((base, converted))]
    for key in ("loss", "logps/chosen", "logps/rejected"):
        assert dpo[1][key] == pytest.approx(dpo[0][key], rel=1e-5, abs=1e-6), key

    prompts = Dataset.from_list([{"prompt": "To be or not"}] * 4)
    grpo = [_trl_run(trl.GRPOTrainer, trl.GRPOConfig, m, tmp_path / f"grpo{i}", prompts, per_device_train_batch_size=4,
                     num_generations=4, max_completion_length=6,
                     reward_funcs=lambda completions, **_: [float(len(c)) for c in completions])
            for i, m in enumerate((base, converted))]
    for key in ("reward", "reward_std", "entropy"):
        assert grpo[1][key] == pytest.approx(grpo[0][key], rel=1e-5), key
