"""The variant spec recorded in the weights files' metadata (issue 23): an edited config.json cannot make a saved
model load with another attention function. Real transformers save/load of tiny models, offline."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_hf_common import left_padded, perturb, tiny
from transformers import AutoModelForCausalLM

from affine_attention.hf.layers import make_spec
from affine_attention.hf.load import load_model

# The record's keys are a file format: spelled out here, so renaming one in the code fails these tests.
SPEC, SPEC_FORMAT = "affine_attention.spec", "affine_attention.spec_format"


def _saved(tmp_path, attention, name="ckpt", **save_kwargs):
    model = tiny("llama", attention)
    perturb(model)
    path = tmp_path / name
    model.save_pretrained(path, **save_kwargs)
    return model, path


def _edit(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["affine_attention"])
    (path / "config.json").write_text(json.dumps(cfg))


def _metadata(file) -> dict:
    with safe_open(str(file), framework="pt") as f:
        return f.metadata() or {}


def _logits(model):
    ids, mask, pos = left_padded(T=10)
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=pos).logits


def _shown(spec) -> str:
    """A spec as the error shows it: all options filled in, keys sorted."""
    return str(json.loads(json.dumps(make_spec(spec["variant"], spec.get("options")), sort_keys=True)))


def _strip_records(path):
    """Rewrite every weights file as an older release saved it: transformers' metadata only."""
    for file in path.glob("*.safetensors"):
        save_file(load_file(file), file, metadata={"format": "pt"})


EDITS = [
    ("softmax", lambda s: s.update(variant="off_by_one")),
    ("off_by_one", lambda s: s.update(variant="softmax")),
    ("affine", lambda s: s["options"].update(activation="sigmoid")),  # phi: the same weights, another function
    ("sink", lambda s: s["options"].update(init=-5.0)),
    ("scaled_softmax", lambda s: s["options"].update(scale=0.7)),  # no weight: only the record tells
]


@pytest.mark.parametrize("variant, edit", EDITS, ids=[f"{v}-{i}" for i, (v, _) in enumerate(EDITS)])
def test_edited_config_is_refused_naming_both_specs_the_file_and_the_fix(tmp_path, variant, edit):
    _, path = _saved(tmp_path, variant)
    saved = json.loads((path / "config.json").read_text())["affine_attention"]
    _edit(path, edit)
    edited = json.loads((path / "config.json").read_text())["affine_attention"]
    for load in (AutoModelForCausalLM.from_pretrained, load_model):  # transformers' entry point and this package's
        with pytest.raises(ValueError) as err:
            load(str(path))
        message = str(err.value)
        assert str(path / "model.safetensors") in message
        assert _shown(saved) in message and _shown(edited) in message
        assert "Restore config.json" in message and "affine_attention.convert" in message


@pytest.mark.parametrize("variant", ["softmax", "off_by_one", "affine", "sink", "scaled_softmax"])
def test_unedited_checkpoint_loads_without_warning_and_gives_the_same_logits(tmp_path, variant):
    model, path = _saved(tmp_path, variant)
    meta = _metadata(path / "model.safetensors")
    assert json.loads(meta[SPEC]) == make_spec(variant, model.config.affine_attention["options"])
    assert meta[SPEC_FORMAT] == "1" and meta["format"] == "pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recorded, matching spec loads silently
        loaded = AutoModelForCausalLM.from_pretrained(path).eval()
        via_helper = load_model(str(path))
    assert torch.equal(_logits(model), _logits(loaded))
    assert torch.equal(_logits(model), _logits(via_helper))


@pytest.mark.parametrize("weights_variant", [None, "v1"])  # transformers' `variant`: model.v1-00001-of-...
def test_every_shard_carries_the_spec_and_an_edit_is_refused(tmp_path, weights_variant):
    model, path = _saved(tmp_path, "off_by_one", max_shard_size="20KB", variant=weights_variant)
    index_name = "model.safetensors.index.json" if weights_variant is None else "model.safetensors.index.v1.json"
    index = json.loads((path / index_name).read_text())
    shards = sorted(path.glob("model*.safetensors"))
    assert len(shards) > 2 and {s.name for s in shards} == set(index["weight_map"].values())
    for shard in shards:
        assert json.loads(_metadata(shard)[SPEC]) == {"variant": "off_by_one", "options": {}}, shard
    loaded = AutoModelForCausalLM.from_pretrained(path, variant=weights_variant).eval()
    assert torch.equal(_logits(model), _logits(loaded))
    _edit(path, lambda s: s.update(variant="softmax"))
    with pytest.raises(ValueError, match=r"model(\.v1)?-00001-of-\d+\.safetensors"):
        AutoModelForCausalLM.from_pretrained(path, variant=weights_variant)


def test_checkpoint_of_an_older_release_loads_with_a_warning(tmp_path):
    """No record to compare: refusing would strand every checkpoint saved before the record existed, loading
    silently would hide that nothing was checked. So it loads, as its config says, and warns how to record it."""
    model, path = _saved(tmp_path, "off_by_one")
    _strip_records(path)
    assert SPEC not in _metadata(path / "model.safetensors")
    with pytest.warns(UserWarning, match="carry no record of their attention-variant spec.*save it again"):
        loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert torch.equal(_logits(model), _logits(loaded))
    loaded.save_pretrained(tmp_path / "again")  # saving it again records the spec
    assert json.loads(_metadata(tmp_path / "again" / "model.safetensors")[SPEC])["variant"] == "off_by_one"


def test_shards_from_different_saves_are_refused(tmp_path):
    _, path = _saved(tmp_path, "softmax", max_shard_size="20KB")
    first = sorted(path.glob("model-*.safetensors"))[0]
    save_file(load_file(first), first, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="carry no attention-variant spec while the others do"):
        AutoModelForCausalLM.from_pretrained(path)


def test_a_file_the_save_did_not_write_keeps_its_own_record(tmp_path):
    """A sharded save over an unsharded one leaves model.safetensors, which transformers reads first: the new save
    must not vouch for it, so its own (off_by_one) record refuses the softmax config."""
    _saved(tmp_path, "off_by_one")
    _, path = _saved(tmp_path, "softmax", max_shard_size="20KB")
    assert json.loads(_metadata(path / "model.safetensors")[SPEC])["variant"] == "off_by_one"
    with pytest.raises(ValueError, match=r"saved with \{'options': \{\}, 'variant': 'off_by_one'\}"):
        AutoModelForCausalLM.from_pretrained(path)


def test_plain_config_in_place_of_a_converted_one_is_refused_by_the_loader(tmp_path):
    """config.json replaced by the original model's: transformers loads softmax; the package's loader refuses."""
    _, path = _saved(tmp_path, "off_by_one")
    cfg = json.loads((path / "config.json").read_text())
    for key in ("affine_attention", "attn_implementation", "auto_map"):
        cfg.pop(key, None)
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="describes an unconverted LlamaForCausalLM.*'off_by_one'"):
        load_model(str(path))


def test_a_record_in_an_unknown_format_is_refused(tmp_path):
    _, path = _saved(tmp_path, "softmax")
    weights = path / "model.safetensors"
    save_file(load_file(weights), weights, metadata={**_metadata(weights), SPEC_FORMAT: "99"})
    with pytest.raises(ValueError, match="format '99'.*Upgrade affine-attention"):
        AutoModelForCausalLM.from_pretrained(path)


def test_push_to_hub_uploads_recorded_weights(tmp_path, monkeypatch):
    """save_pretrained(push_to_hub=True) uploads from inside transformers' save; what it uploads has the record."""
    import transformers.modeling_utils as mu
    from transformers.utils.hub import PushToHubMixin

    uploaded = {}

    class Repo:
        repo_id = "user/tiny"

    class Api:
        def create_repo(self, *args, **kwargs):
            return Repo()

    class Card:
        def save(self, path):
            open(path, "w").close()

    def upload(self, working_dir, *args, **kwargs):
        uploaded.update({f: _metadata(os.path.join(working_dir, f)) for f in os.listdir(working_dir)
                         if f.endswith(".safetensors")})

    monkeypatch.setattr(mu, "hf_api", lambda: Api())
    monkeypatch.setattr(mu, "create_and_tag_model_card", lambda *a, **k: Card())
    monkeypatch.setattr(PushToHubMixin, "_upload_modified_files", upload)
    _saved(tmp_path, "off_by_one", push_to_hub=True)
    assert uploaded and all(json.loads(m[SPEC])["variant"] == "off_by_one" for m in uploaded.values())


def test_pickled_weights_of_a_converted_checkpoint_are_never_unpickled(tmp_path, monkeypatch):
    _, path = _saved(tmp_path, "softmax")
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    os.remove(path / "model.safetensors")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(ValueError, match="never loads pickled weights"):
        AutoModelForCausalLM.from_pretrained(path)
