"""save_pretrained / from_pretrained of converted models: exact round trip, guards against loading as softmax,
the trust_remote_code (Hub) path, corrupted files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_hf_common import FAMILIES, left_padded, perturb, richest, tiny, variant_state
from transformers import AutoModelForCausalLM

from affine_attention.variants import variant_names


def _roundtrip(model, path):
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _check_same(model, loaded):
    assert type(loaded) is type(model)
    assert loaded.config.affine_attention == model.config.affine_attention
    mine, theirs = variant_state(model), variant_state(loaded)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids, mask, pos = left_padded(T=10)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits,
                           loaded(ids, attention_mask=mask, position_ids=pos).logits)
    # non-persistent constants (off_by_one sinks, scaled_softmax scale) are rebuilt, not left uninitialised
    for (n, a), (_, b) in zip(model.named_buffers(), loaded.named_buffers()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("variant", variant_names())
def test_roundtrip_every_variant(variant, tmp_path):
    model = tiny("llama", variant)
    perturb(model)
    _check_same(model, _roundtrip(model, tmp_path))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_roundtrip_every_family(family, tmp_path):
    model = tiny(family, richest(family), dtype=torch.bfloat16)
    perturb(model)
    loaded = _roundtrip(model, tmp_path)
    assert loaded.dtype == torch.bfloat16
    _check_same(model, loaded)


def test_checkpoint_files(tmp_path):
    model = tiny("qwen2", "affine")
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "affine_qwen2" and cfg["architectures"] == ["AffineQwen2ForCausalLM"]
    assert cfg["affine_attention"]["variant"] == "affine" and cfg["attn_implementation"] == "affine_attention"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "affine_attention_loader.AffineQwen2ForCausalLM"
    assert "import affine_attention" in (tmp_path / "affine_attention_loader.py").read_text()


def _run(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env=env, timeout=300)


def test_never_loads_as_softmax_without_the_package(tmp_path):
    """In a fresh interpreter without `import affine_attention`, every loading route fails loudly."""
    model = tiny("llama", "off_by_one")  # no new weights at all: only the config can tell
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    auto = _run(f"from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained({str(ckpt)!r})",
                tmp_path)
    assert auto.returncode != 0 and "ValueError" in auto.stderr and "trust_remote_code=True" in auto.stderr
    direct = _run(f"from transformers import LlamaForCausalLM\nLlamaForCausalLM.from_pretrained({str(ckpt)!r})",
                  tmp_path)
    assert direct.returncode != 0 and 'attn_implementation="affine_attention"` is not supported' in direct.stderr


def test_tokenizer_of_a_converted_folder_loads_without_the_package(tmp_path):
    """AutoTokenizer reads config.json through AutoConfig before it picks a tokenizer class; in a process that never
    imported the package, the folder's model type is unknown and its auto_map (the model's trust_remote_code path)
    makes transformers ask "Do you wish to run the custom code?" although the tokenizer needs none. The documented
    way, trust_remote_code=False, declines only the model's loader: no question, nothing of the package imported,
    the same token ids. (Plain AutoTokenizer.from_pretrained still asks: transformers' behaviour, documented.)"""
    from affine_attention.text.corpus import default_tokenizer

    tok = default_tokenizer()
    ckpt = tmp_path / "ckpt"
    tiny("llama", "affine", vocab_size=len(tok)).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    text = "To be, or not to be"

    def load(extra: str) -> subprocess.CompletedProcess:
        return _run(f"import sys\nfrom transformers import AutoTokenizer\n"
                    f"t = AutoTokenizer.from_pretrained({str(ckpt)!r}{extra})\n"
                    f"assert not any(m.startswith('affine_attention') for m in sys.modules)\n"
                    f"print(t({text!r}).input_ids)", tmp_path)

    declined = load(", trust_remote_code=False")
    assert declined.returncode == 0, declined.stderr[-2000:]
    assert "custom code" not in declined.stdout + declined.stderr
    assert declined.stdout.strip().splitlines()[-1] == str(tok(text).input_ids)
    asked = load("")
    assert "Do you wish to run the custom code?" in asked.stdout + asked.stderr


def _saved_with_logits(family: str, tmp_path):
    """A perturbed tiny sink model saved to tmp_path/ckpt, its logits on 12 tokens in tmp_path/ref.pt; the code that
    checks a reloaded `m` gives the same."""
    model = tiny(family, "sink")
    perturb(model)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    with torch.no_grad():
        torch.save(model(torch.arange(12)[None]).logits, tmp_path / "ref.pt")
    same = f"assert torch.equal(m(torch.arange(12)[None]).logits, torch.load({str(tmp_path / 'ref.pt')!r}))\n"
    return str(ckpt), same


@pytest.mark.parametrize("first", [pytest.param("import affine_attention", marks=pytest.mark.slow),
                                   pytest.param("import affine_attention.hf.attention", marks=pytest.mark.slow),
                                   "from affine_attention import peft_config"])
def test_the_auto_classes_load_a_checkpoint_whichever_module_imported_transformers(first, tmp_path):
    """Registration runs once transformers is imported, also when a module of the package imported it (the seam,
    or hf.packing on the way from peft_config): then once that module has finished, never half-way, never twice."""
    ckpt, same = _saved_with_logits("llama", tmp_path)
    code = (f"{first}\nimport torch\nfrom transformers import AutoModelForCausalLM\n"
            f"from affine_attention.hf import _autoload\nassert not _autoload.installed()\n"
            f"m = AutoModelForCausalLM.from_pretrained({ckpt!r}).eval()\n"
            f"assert type(m).__name__ == 'AffineLlamaForCausalLM', type(m)\n{same}")
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_trust_remote_code_loads_through_the_package(tmp_path):
    """The Hub path: the checkpoint's loader file imports affine_attention by itself."""
    ckpt, same = _saved_with_logits("qwen3", tmp_path)
    code = (f"import torch\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({ckpt!r}, trust_remote_code=True).eval()\n"
            f"assert type(m).__module__ == 'affine_attention.hf.models', type(m)\n{same}")
    run = _run(code, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]


def test_plain_class_with_package_refuses_to_run(tmp_path):
    from transformers import LlamaForCausalLM

    model = tiny("llama", "affine")
    model.save_pretrained(tmp_path)
    plain = LlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="loaded through its original class"):
        plain(torch.arange(4)[None])


def test_corrupted_or_truncated_weights_fail_clearly(tmp_path):
    model = tiny("llama", "affine")
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    for broken in (data[: len(data) // 2], b"\xff" * 8 + data[8:], data[:64] + b"\x00" * 32 + data[96:]):
        weights.write_bytes(broken)
        with pytest.raises(ValueError, match="truncated or corrupted"):
            AutoModelForCausalLM.from_pretrained(tmp_path)


def test_missing_variant_weights_fail(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny("llama", "affine")
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = {k: v for k, v in load_file(weights).items() if "alpha_proj" not in k}
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 2 weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_explicit_other_attention_is_refused(tmp_path):
    model = tiny("llama", "affine")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="leave `attn_implementation` unset"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
