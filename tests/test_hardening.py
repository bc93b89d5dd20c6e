"""Edges a new user or an adversarial tester reaches (issue 14): every bad input a ValueError naming the argument,
config and CLI errors as one line, nothing written silently replaced, checkpoints that trust only their manifest,
saved models that load only with the function they were saved with."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from affine_attention.ops import affine_scaled_attention, sink_attention, softmax_attention
from affine_attention.variants import AttentionShape, build_variant, parse_options

from test_train_helpers import tiny, unfinish  # noqa: F401  (fixture)

B, H, T, D = 2, 4, 5, 8
SHAPE = AttentionShape(32, H, 2, D)


def _qkv(S=T, d=D, dtype=torch.float32):
    return torch.randn(B, H, T, d, dtype=dtype), torch.randn(B, H, S, d, dtype=dtype), torch.randn(B, H, S, d,
                                                                                                dtype=dtype)


def _alpha():
    return torch.rand(B, H, T), torch.rand(H)


META = torch.device("meta")  # "another device" without a GPU: the check must fire before any computation


# --- class 3: ops ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, match", [
    (lambda: affine_scaled_attention(*_qkv(S=0), *_alpha()), r"at least one key \(S >= 1\)"),
    (lambda: sink_attention(*_qkv(S=0), torch.zeros(H)), r"at least one key"),
    (lambda: softmax_attention(*_qkv(S=0)), r"at least one key"),
    (lambda: affine_scaled_attention(*_qkv(d=0), *_alpha()), r"head dimension D >= 1"),
    (lambda: softmax_attention(*_qkv(d=0)), r"head dimension D >= 1"),
    (lambda: affine_scaled_attention(*_qkv(), torch.rand(B, H, T, device=META), torch.rand(H)),
     r"alpha is on meta but q is on cpu"),
    (lambda: affine_scaled_attention(*_qkv(), torch.rand(B, H, T), torch.rand(H, device=META)),
     r"alpha_ma is on meta"),
    (lambda: sink_attention(*_qkv(), torch.zeros(H, device=META)), r"sinks is on meta"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), v_mean=torch.zeros(B, H, T, D, device=META)),
     r"v_mean is on meta"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), v_mean=torch.zeros(B, H, T, D, dtype=torch.int64)),
     r"v_mean must be floating point"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), v_mean=torch.zeros(B, H, T + 1, D)), r"v_mean must have"),
    (lambda: affine_scaled_attention(*_qkv(), *_alpha(), v_mean=[0.0]), r"v_mean must have shape"),
    (lambda: affine_scaled_attention(*_qkv(), torch.randint(0, 2, (B, H, T)), torch.rand(H)),
     r"alpha must be floating point"),
    (lambda: softmax_attention(*_qkv(), scale=float("inf")), r"scale must be a finite positive"),
    (lambda: softmax_attention(*_qkv(), scale=float("nan")), r"scale must be a finite positive"),
    (lambda: sink_attention(*_qkv(), torch.zeros(H), scale=0.0), r"scale must be a finite positive"),
    (lambda: softmax_attention(*_qkv(), scale=True), r"scale must be a finite positive"),
])
def test_ops_refuse_bad_input(case, match):
    with pytest.raises(ValueError, match=match):
        case()


# --- class 3: variants, build_variant, AttentionShape, convert ------------------------------------------------
@pytest.mark.parametrize("make, match", [
    (lambda: build_variant("affine", {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}),
     r"shape must be an AttentionShape"),
    (lambda: build_variant("softmax", (32, 4, 2, 8)), r"shape must be an AttentionShape"),
    (lambda: AttentionShape(True, 4, 2, 8), r"hidden_size must be a positive int"),
    (lambda: AttentionShape(32, 4, 0, 8), r"num_kv_heads must be a positive int"),
    (lambda: AttentionShape(32, 4, 2, 8.0), r"head_dim must be a positive int"),
    (lambda: build_variant("sink", SHAPE, init=float("nan")), r"'init' must be a finite number"),
    (lambda: build_variant("sink", SHAPE, init=float("inf")), r"'init' must be a finite number"),
    (lambda: build_variant("scaled_softmax", SHAPE, scale=float("nan")), r"'scale' must be a finite number"),
    (lambda: build_variant("scaled_softmax", SHAPE, scale=-0.5), r"'scale' must be a finite number >= 0"),
    (lambda: build_variant("scaled_softmax", SHAPE, scale=-1e-30), r"'scale' must be a finite number >= 0"),
    (lambda: build_variant("affine", SHAPE, momentum=float("nan")), r"'momentum' must be a finite"),
    (lambda: build_variant("affine_frozen", SHAPE, frozen_alpha=float("-inf")), r"'frozen_alpha' must be a finite"),
    (lambda: build_variant("gated", SHAPE, nonsense=1), r"unknown option"),
    (lambda: __import__("affine_attention.variants", fromlist=["x"]).SinkAttention(SHAPE, {"init": 0.0}),
     r"options must be SinkOptions"),
])
def test_variants_refuse_bad_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_convert_refuses_bad_input():
    import affine_attention
    from test_hf_common import tiny as tiny_model

    for args, kwargs, match in (((None, "affine"), {}, r"cannot convert NoneType"),
                                (("model", 3), {}, r"variant must be a name"),
                                (("model", "affinee"), {}, r"unknown attention variant 'affinee'"),
                                (("model", "affine"), {"momentum": "0.9"}, r"'momentum' must be a number"),
                                (("model", "sink"), {"init": float("nan")}, r"'init' must be a finite"),
                                (("model", "affine"), {"function_preserving": 1}, r"function_preserving must be")):
        model = tiny_model("llama")
        args = tuple(model if a == "model" else a for a in args)
        with pytest.raises(ValueError, match=match):
            affine_attention.convert(*args, **kwargs)
        assert not hasattr(model.model.layers[0].self_attn, "attn_variant")  # refused before anything changed


def test_variant_options_built_directly_are_checked_too():
    from affine_attention.variants.scaled_softmax import ScaledSoftmaxOptions
    from affine_attention.variants.sink import SinkOptions

    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="init"):
            SinkOptions(init=bad)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="scale"):
            ScaledSoftmaxOptions(scale=bad)
    assert parse_options("sink", {"init": -3}).init == -3.0


@pytest.mark.parametrize("variant", ["softmax", "affine", "sink", "gated"])
def test_layer_refuses_mixed_float64_and_foreign_device_input(variant):
    layer = build_variant(variant, SHAPE)
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, 2, T, D), torch.randn(B, 2, T, D)
    with pytest.raises(ValueError, match=r"x is torch.float64 but q is torch.float32"):
        layer(q, k, v, torch.randn(B, T, 32, dtype=torch.float64), is_causal=True)
    with pytest.raises(ValueError, match=r"x is torch.float32 but q is torch.float64"):
        layer.double()(q.double(), k.double(), v.double(), torch.randn(B, T, 32), is_causal=True)
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor on q's device"):
        layer(q.double(), k.double(), v.double(), torch.randn(B, T, 32, dtype=torch.float64, device=META))
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor"):
        layer(q.double(), k.double(), v.double(), torch.ones(B, T, 32, dtype=torch.int64))


# --- class 4: config values ------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, match", [
    ("model.num_kv_heads=0", r"model.num_kv_heads must be positive"),
    ("model.hidden_size=0", r"model.hidden_size must be positive"),
    ("model.intermediate_size=-1", r"model.intermediate_size must be positive"),
    ("model.head_dim=-8", r"model.head_dim must be positive"),
    ("model.max_position_embeddings=0", r"model.max_position_embeddings must be positive"),
    ("optim.lr=0", r"optim.lr must be finite and > 0"),
    ("optim.lr=-1e-3", r"optim.lr must be finite and > 0"),
    ("optim.lr=nan", r"optim.lr must be finite"),
    ("optim.lr=inf", r"optim.lr must be finite"),
    ("optim.weight_decay=-0.1", r"optim.weight_decay must be finite and >= 0"),
    ("optim.clip_grad_norm=-1.0", r"optim.clip_grad_norm must be finite and >= 0 \(0 disables"),
    ("optim.eps=0", r"optim.eps must be finite and > 0"),
    ("optim.betas=[0.9, 1.0]", r"optim.betas must be two numbers in \[0, 1\)"),
    ("data.seq_len=100000", r"data.seq_len \(100000\) exceeds model.max_position_embeddings"),
])
def test_config_values_are_checked_with_the_key_named(override, match):
    from affine_attention.train.config_load import load_config

    with pytest.raises(ValueError, match=match) as err:
        load_config("tiny", [override])
    assert "tiny.toml" in str(err.value) and "\n" not in str(err.value)


def test_config_edges_that_stay_valid():
    from affine_attention.train.config_load import load_config, preset_names

    for name in preset_names():
        load_config(name)
    load_config("tiny", ["optim.weight_decay=0", "optim.clip_grad_norm=0"])


# --- class 4: the text reader ----------------------------------------------------------------------------------
def test_text_reader_names_file_and_line(tmp_path):
    from affine_attention.text import documents

    cases = {
        "number.jsonl": (b'{"text": "ok"}\n{"text": 5}\n', r"number.jsonl:2: expected a JSON object"),
        "list.jsonl": (b'["text"]\n', r"list.jsonl:1: expected a JSON object"),
        "cut.jsonl": (b'{"text": "ok"}\n\n{"text": \n', r"cut.jsonl: line 3: malformed JSON"),
        "latin1.jsonl": ('{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"),
                         r"latin1.jsonl: line 2: not UTF-8 text"),
        "latin1.txt": ("line one\nline two caf\u00e9\n".encode("latin-1"), r"latin1.txt: line 2: not UTF-8 text"),
        "binary.md": (b"\xff\xfe\x00\x01", r"binary.md: line 1: not UTF-8"),
    }
    for name, (data, match) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=match):
            list(documents("files", paths=[str(tmp_path / name)]))
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "plain").mkdir()
    for name in ("folder.jsonl", "plain"):
        with pytest.raises(ValueError, match=r"is not a file; name files or a glob"):
            list(documents("files", paths=[str(tmp_path / name)]))


# --- class 4 and 5: CLI lines, run folders ---------------------------------------------------------------------
def _one_error_line(out, *needles):
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_cli_bad_inputs_give_one_line(tiny, tmp_path):
    """In this process (cli.main), then the first case once more through the installed command's process."""
    from test_train_helpers import cli, cli_in_process, sets

    base = sets(tiny + ["train.steps=1"])
    (tmp_path / "bad.jsonl").write_text('{"text": ["not", "a", "string"]}\n')
    (tmp_path / "cut.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text("{}")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    cases = [
        (sets([f"data.train.paths=['{tmp_path / 'bad.jsonl'}']"]) + ["--out", str(tmp_path / "o1")],
         ["bad.jsonl:1", "string field 'text'"]),
        (sets([f"data.train.paths=['{tmp_path / 'cut.jsonl'}']"]) + ["--out", str(tmp_path / "o5")],
         ["cut.jsonl: line 2", "malformed JSON"]),
        (sets([f"data.train.paths=['{tmp_path / 'latin1.txt'}']"]) + ["--out", str(tmp_path / "o6")],
         ["latin1.txt: line 1", "not UTF-8"]),
        (sets(["optim.lr=0"]) + ["--out", str(tmp_path / "o7")], ["optim.lr must be finite and > 0"]),
        (sets(["data.seq_len=4096"]) + ["--out", str(tmp_path / "o8")], ["max_position_embeddings"]),
        (sets([f"data.train.paths=['{tmp_path / 'adir'}']"]) + ["--out", str(tmp_path / "o2")],
         ["adir", "is not a file"]),
        (sets([f"data.tokenizer='{tmp_path / 'notok'}'"]) + ["--out", str(tmp_path / "o3")],
         ["notok", "holds no tokenizer"]),
        (["--out", str(tmp_path / "afile")], ["afile", "is an existing file"]),
        (["--resume", "--out", str(tmp_path / "missing" / "dir")], ["missing/dir", "does not exist"]),
        (sets(["model.num_kv_heads=0"]) + ["--out", str(tmp_path / "o4")], ["model.num_kv_heads"]),
    ]
    for extra, needles in cases:
        _one_error_line(cli_in_process(["train", *base, *extra]), *needles)
    _one_error_line(cli(["train", *base, *cases[0][0]], check=False), *cases[0][1])
    assert not (tmp_path / "missing").exists()  # a failed --resume creates nothing
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 9))


def _train(cfg, out, **kw):
    from affine_attention.train.loop import train

    return train(cfg, out, log=kw.pop("log", lambda m: None), **kw)


def test_nothing_written_is_replaced_and_a_lost_result_is_rebuilt(tiny, tmp_path):
    from affine_attention.train.config_load import load_config

    cfg = load_config("tiny", tiny + ["train.steps=2", "variant.name='sink'"])
    run = tmp_path / "r"
    first = _train(cfg, run)
    weights = (run / "final" / "model.safetensors").read_bytes()
    # Another run's checkpoints and final model without its metrics.jsonl / result.json: still refused.
    for gone in ("metrics.jsonl", "result.json"):
        (run / gone).rename(tmp_path / gone)
    for held in ("final", "checkpoints"):
        other = tmp_path / f"other-{held}"
        (other / held).mkdir(parents=True)
        with pytest.raises(ValueError, match=rf"already holds a run \({held}\)"):
            _train(cfg, other)
    with pytest.raises(ValueError, match=r"already holds a run \(final, checkpoints\)"):
        _train(cfg, run)
    assert (run / "final" / "model.safetensors").read_bytes() == weights
    # Killed between final/ and result.json: the resume rebuilds result.json with its held-out numbers.
    (tmp_path / "metrics.jsonl").rename(run / "metrics.jsonl")
    said = []
    again = _train(cfg, run, resume=True, log=said.append)
    assert any("already complete" in m for m in said)
    assert again["heldout_loss"] == pytest.approx(first["heldout_loss"]) and again["heldout_ppl"] is not None
    assert json.loads((run / "result.json").read_text())["heldout_loss"] == pytest.approx(first["heldout_loss"])
    # Without its eval record too: the numbers are measured again on the final weights.
    lines = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "eval"' not in line]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    (run / "result.json").unlink()
    third = _train(cfg, run, resume=True)
    assert third["heldout_loss"] == pytest.approx(first["heldout_loss"], rel=1e-6)


# --- class 6: checkpoints trust only their manifest ------------------------------------------------------------
@pytest.fixture
def two_checkpoints(tiny, tmp_path):
    from affine_attention.train.config_load import load_config

    cfg = load_config("tiny", tiny + ["train.steps=4", "train.checkpoint_every=1", "train.keep_checkpoints=5",
                                      "variant.name='affine'"])
    run = tmp_path / "run"
    _train(cfg, run)
    unfinish(run)
    return cfg, run


@pytest.mark.parametrize("manifest", ["[]", '"x"', "3", "null", '{"format": 1, "files": {}}',
                                      '{"format": 1, "step": 3}', '{"format": 1, "step": "3", "files": {"a": 1}}',
                                      '{"format": 1, "step": 3, "files": {"config.json": {"size": 1}}}',
                                      '{"format": 1, "step": 3, "files": {"../x": {"size": 1, "sha256": "0"}}}'])
def test_malformed_manifest_falls_back_to_the_previous_checkpoint(two_checkpoints, manifest):
    from affine_attention.train import checkpoint as ckpt

    cfg, run = two_checkpoints
    newest = run / "checkpoints" / "step-00000003"
    (newest / "MANIFEST.json").write_text(manifest)
    assert ckpt.verify(newest) is not None
    said = []
    path = ckpt.newest_intact(run, log=said.append)
    assert path.name == "step-00000002" and any(f"{newest} is damaged" in m for m in said)


def test_unlisted_files_are_never_loaded_and_partial_saves_are_cleaned(two_checkpoints):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from affine_attention.hf.load import load_model
    from affine_attention.train import checkpoint as ckpt

    cfg, run = two_checkpoints
    newest = run / "checkpoints" / "step-00000003"
    real = load_model(str(newest)).state_dict()
    # A planted DCP shard beside the real one, holding the same tensors (same header) with other values: listed
    # nowhere, so never loaded.
    shard = next((newest / "state").glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        header = f.metadata()
    planted = newest / "state" / shard.name.replace("shard-00001", "shard-00002")
    save_file({k: torch.full_like(v, 7.0) for k, v in load_file(str(shard)).items()}, str(planted), metadata=header)
    said = []
    assert ckpt.newest_intact(run, log=said.append) == newest
    assert any("ignoring 1 file(s)" in m and planted.name in m for m in said), said
    loaded = load_model(str(newest)).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in real.items())
    # What killed saves leave: a finished temporary folder whose rename was lost is restored, the rest removed.
    done = run / "checkpoints" / ".tmp-step-00000004-deadbeef"
    shutil.copytree(newest, done)
    (done / "trainer_state.json").write_text((done / "trainer_state.json").read_text())  # unchanged bytes
    half = run / "checkpoints" / ".tmp-step-00000005-cafe0000"
    half.mkdir()
    (half / "config.json").write_text("{")
    old = run / ".old-final-12345678"
    old.mkdir()
    said.clear()
    ckpt.recover_partial(run, log=said.append)
    assert (run / "checkpoints" / "step-00000004").is_dir() and not done.exists()
    assert not half.exists() and not old.exists()
    assert sum("removed" in m for m in said) == 2 and sum("restored" in m for m in said) == 1


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickled_weights_are_refused_by_the_loader(tmp_path, name):
    from affine_attention.hf.load import load_model

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / name).write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match=r"pickled weights only .* never loads"):
        load_model(str(folder))
    (folder / name).unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors weights"):
        load_model(str(folder))


def test_eval_and_analyze_refuse_pickles_in_one_line(tmp_path):
    from test_train_helpers import cli_in_process

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04x")
    for args in (["analyze", "--model", str(folder), "--out", str(tmp_path / "a")],
                 ["eval", "--model", str(folder), "--tokenizer", "default", "--tasks", "fixtures", "--out",
                  str(tmp_path / "e")]):
        _one_error_line(cli_in_process(args), "pickled weights only")


# --- class 7: a saved model loads only with the function it was saved with ------------------------------------
def _saved(tmp_path, variant, **options):
    """A tiny converted Llama with non-initial variant state, saved; returns its folder."""
    import affine_attention
    from test_hf_common import perturb, tiny as tiny_model

    model = affine_attention.convert(tiny_model("llama"), variant, **options)
    perturb(model)
    path = tmp_path / f"{variant}-saved"
    model.save_pretrained(path)
    return path


def _edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["affine_attention"])
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("variant, edit, match", [
    ("affine", lambda s: s.update(variant="softmax", options={}), r"attention-variant weight\(s\) that its config"),
    ("affine", lambda s: s.update(variant="affine_frozen", options={**s["options"], "frozen_alpha": 0.5}),
     r"does not use"),
    ("gated", lambda s: s.update(variant="scaled_softmax", options={"scale": 0.5, "learnable": False}),
     r"does not use"),
    ("affine", lambda s: s.update(options={}), r"lacks \['activation', 'bias_norm', 'momentum'\]"),
    ("affine", lambda s: s.pop("options"), r"lacks"),
    ("affine", lambda s: s["options"].pop("bias_norm"), r"lacks \['bias_norm'\]"),
    ("sink", lambda s: s.update(options={}), r"lacks \['init'\]"),
    ("affine", lambda s: s.update(extra_key=1), r"unknown key\(s\) \['extra_key'\]"),
    ("sink", lambda s: s.update(variant="affine"), r"lacks|unknown option|weight"),
])
def test_edited_saved_config_is_a_clear_error(tmp_path, variant, edit, match):
    from transformers import AutoModelForCausalLM

    path = _saved(tmp_path, variant)
    _edit_config(path, edit)
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_pretrained(path)


def test_saved_configs_record_every_option_and_retrofit_stays_accepted(tmp_path):
    from transformers import AutoModelForCausalLM

    from affine_attention.variants import REGISTRY

    for variant in ("affine", "sink", "gated", "scaled_softmax"):
        path = _saved(tmp_path, variant)
        saved = json.loads((path / "config.json").read_text())["affine_attention"]["options"]
        fields = {f for f in REGISTRY[variant].Options.__dataclass_fields__}
        assert set(saved) == fields
        AutoModelForCausalLM.from_pretrained(path)
    path = _saved(tmp_path, "affine", function_preserving=True)
    assert "retrofit" in json.loads((path / "config.json").read_text())["affine_attention"]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert any(n.endswith("alpha_acc") for n, _ in model.named_buffers())


def test_no_value_in_config_is_silently_default(tmp_path):
    """The options removed: the logits would change (up to 0.3 in the issue) if this loaded with defaults."""
    from transformers import AutoModelForCausalLM

    path = _saved(tmp_path, "affine", bias_norm="full", momentum=0.5)
    _edit_config(path, lambda s: s["options"].pop("bias_norm"))
    with pytest.raises(ValueError, match="bias_norm"):
        AutoModelForCausalLM.from_pretrained(path)
