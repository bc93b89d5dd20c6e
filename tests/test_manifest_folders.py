"""Every folder the package writes and reads back is read through its manifest, and every cache is keyed on what
determines its content (issue 43): a file planted in a step checkpoint, an export, a prepared folder, a teacher
cache or a compare folder is never read (and is named); an edited teacher config or a source file added to a glob
is a new cache or a refusal naming it; compare guards its own folder; a manifest missing a key and a read-only
--out are one error line."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from test_train_helpers import cli_in_process, read_records, tiny, unfinish, write_jsonl  # noqa: F401  (fixture)


def _train(cfg, out, **kw):
    from affine_attention.train.loop import train

    return train(cfg, out, log=lambda m: None, **kw)


@pytest.fixture
def four_steps(tiny, tmp_path):
    """A 4-step run with a checkpoint after every step, and its losses."""
    from affine_attention.train.config_load import load_config

    cfg = load_config("tiny", tiny + ["train.steps=4", "train.checkpoint_every=1", "train.keep_checkpoints=5",
                                      "schedule.kind='constant'", "schedule.warmup_steps=0"])
    run = tmp_path / "run"
    _train(cfg, run)
    return cfg, run, [r["loss"] for r in read_records(run / "metrics.jsonl")]


def _plant_other_step(run, into: int, source: int = 1) -> list:
    """Copy step `source`'s shard into step `into`'s state/ under names its manifest does not list (one sorting
    before the real shard, one after), and one file that is no safetensors at all: a reader that opens any of them
    has read what the manifest does not list."""
    steps = run / "checkpoints"
    (shard,) = (steps / f"step-{source:08d}" / "state").glob("*.safetensors")
    state = steps / f"step-{into:08d}" / "state"
    planted = [state / "a-copied.safetensors", state / "zz-copied.safetensors", state / "zzz-garbage.safetensors"]
    shutil.copy(shard, planted[0])
    shutil.copy(shard, planted[1])
    planted[2].write_bytes(b"not a safetensors file")
    return planted


def test_a_shard_planted_in_a_step_checkpoint_is_never_read_by_resume_load_or_export(four_steps, tmp_path, capsys):
    from affine_attention.hf.load import load_model
    from affine_attention.train.export import export

    cfg, run, losses = four_steps
    unfinish(run)  # killed after step 3's checkpoint
    step3 = run / "checkpoints" / "step-00000003"
    real = load_model(str(step3)).state_dict()
    planted = _plant_other_step(run, into=3)
    loaded = load_model(str(step3)).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in real.items())
    err = capsys.readouterr().err
    assert all(p.name in err for p in planted), err  # named, never read
    export(run, tmp_path / "exported", step=3)
    got = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert got.keys() <= real.keys() and all(torch.equal(got[k], real[k]) for k in got)
    _train(cfg, run, resume=True)
    assert [r["loss"] for r in read_records(run / "metrics.jsonl")] == losses  # step 4 from step 3's own tensors


def test_files_planted_in_a_final_folder_are_not_exported_and_an_export_lists_its_files(four_steps, tmp_path):
    _, run, _ = four_steps
    final = run / "final"
    (final / "extra.safetensors").write_bytes((final / "model.safetensors").read_bytes())
    (final / "added_tokens.json").write_text('{"<planted>": 4096}')
    from affine_attention.train.export import export

    export(run, tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "extra.safetensors" not in names and "added_tokens.json" not in names, names
    manifest = json.loads((tmp_path / "out" / "MANIFEST.json").read_text())
    assert sorted(manifest["files"]) == sorted(n for n in names if n != "MANIFEST.json") and manifest["step"] == 4


def _teacher_cache(root, key, ids, fill):
    from affine_attention.train.teacher_cache import TeacherCache

    cache = TeacherCache(str(root), key, shard_sequences=len(ids))
    cache.put(ids, torch.full((len(ids), 5, 3), fill, dtype=torch.float16), torch.zeros(len(ids), 5, 3))
    return cache


def test_a_shard_planted_in_a_teacher_cache_is_never_read(tmp_path, capsys):
    from affine_attention.train.teacher_cache import TeacherCache

    ours = _teacher_cache(tmp_path, {"teacher": "t", "k": 3}, [1, 2], 1.0)
    other = _teacher_cache(tmp_path, {"teacher": "another", "k": 3}, [7, 8], 9.0)  # a valid shard of other logits
    (shard,) = other.dir.glob("shard-*.safetensors")
    shutil.copy(shard, ours.dir / shard.name)
    capsys.readouterr()
    fresh = TeacherCache(str(tmp_path), {"teacher": "t", "k": 3})
    assert fresh.get([7, 8]) == [None, None]  # recomputed from the teacher, not taken from the other cache
    assert torch.equal(fresh.get([1])[0][0], torch.full((5, 3), 1.0, dtype=torch.float16))
    assert shard.name in capsys.readouterr().err


def test_a_file_planted_in_a_prepared_folder_is_named_and_not_read(tmp_path, capsys):
    from affine_attention.train.config_load import load_config
    from affine_attention.train.prepare import prepare
    from affine_attention.train.pretrained import load_tokenizer
    from affine_attention.train.shards import TokenSource

    docs = write_jsonl(tmp_path / "docs.jsonl", [f"Document {i}. " + "Words of text. " * 9 for i in range(12)])
    cfg = load_config("tiny", ["data.train.kind='files'", f"data.train.paths=['{docs}']", "data.seq_len=16"])
    prepare(cfg, tmp_path / "p", shard_documents=5, log=lambda m: None)
    tok = load_tokenizer("default")
    before = TokenSource(tmp_path / "p", tok, tok.eos_token_id, 16, 0, False).take(4)
    shutil.copy(tmp_path / "p" / "shard-00000.npy", tmp_path / "p" / "shard-00003.npy")
    capsys.readouterr()
    after = TokenSource(tmp_path / "p", tok, tok.eos_token_id, 16, 0, False).take(4)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert "shard-00003.npy" in capsys.readouterr().err


def test_a_run_planted_in_a_compare_folder_is_not_read(tmp_path, capsys):
    from affine_attention.analysis.compare_run import load_run

    root = tmp_path / "cmp"
    for variant in ("softmax", "affine", "planted"):
        log = root / variant / "seed0" / "metrics.jsonl"
        log.parent.mkdir(parents=True)
        log.write_text(json.dumps({"kind": "train", "step": 0, "loss": 1.0}) + "\n")
    (root / "comparison.json").write_text(json.dumps({"format": 1, "variants": ["softmax", "affine"], "seeds": 1,
                                                      "runs": ["softmax/seed0", "affine/seed0"]}))
    _, runs = load_run(root)
    assert list(runs) == ["softmax", "affine"]
    assert "planted/seed0" in capsys.readouterr().err


# --- every cache keyed on what determines its content ------------------------------------------------------------
def test_the_teacher_cache_is_keyed_on_the_teachers_config_and_weights_by_content(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from affine_attention.train.pretrained import teacher_identity
    from affine_attention.train.teacher_cache import TeacherCache

    teacher = tmp_path / "teacher"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(teacher)

    def cache_dir():  # the key kd.Teacher builds
        return TeacherCache(str(tmp_path / "cache"), {"data": "d", "teacher": teacher_identity(str(teacher))}).dir

    first = cache_dir()
    weights = teacher / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched, same bytes
    assert cache_dir() == first
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.1}))
    capsys.readouterr()
    edited = cache_dir()
    assert edited != first and "config.json" in capsys.readouterr().err  # a new cache, saying what changed
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the weights retrained: same name, same size
    weights.write_bytes(bytes(data))
    assert cache_dir() not in (first, edited)


def test_a_preparation_continued_after_its_source_changed_is_refused_naming_the_file(tmp_path, monkeypatch):
    from affine_attention.train import shards as shards_mod
    from affine_attention.train.config_load import load_config
    from affine_attention.train.prepare import prepare

    src = tmp_path / "src"
    src.mkdir()
    for name in ("a", "c", "d"):
        write_jsonl(src / f"{name}.jsonl", [f"Document {name}{i}. " + "Some words. " * 5 for i in range(3)])
    cfg = load_config("tiny", ["data.train.kind='files'", f"data.train.paths=['{src}/*.jsonl']", "data.seq_len=16"])
    real = shards_mod.write_shard

    def dies_at_shard_1(folder, k, tokens, ends):
        if k == 1:
            raise KeyboardInterrupt
        return real(folder, k, tokens, ends)

    monkeypatch.setattr("affine_attention.train.prepare.write_shard", dies_at_shard_1)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, tmp_path / "p", shard_documents=3, log=lambda m: None)
    monkeypatch.setattr("affine_attention.train.prepare.write_shard", real)
    manifest = (tmp_path / "p" / "manifest.json").read_text()
    write_jsonl(src / "b.jsonl", ["A new document b."])  # between a and c in the glob's order
    with pytest.raises(ValueError, match=r"b\.jsonl"):
        prepare(cfg, tmp_path / "p", shard_documents=3, log=lambda m: None)
    (src / "b.jsonl").unlink()
    write_jsonl(src / "d.jsonl", ["d, rewritten"])
    with pytest.raises(ValueError, match=r"edited.*d\.jsonl"):
        prepare(cfg, tmp_path / "p", shard_documents=3, log=lambda m: None)
    assert (tmp_path / "p" / "manifest.json").read_text() == manifest  # nothing changed


def test_a_stream_position_and_a_token_cache_are_keyed_on_what_their_tokens_come_from(tmp_path, monkeypatch):
    """A hub stream's resume position (datasets' json builder over local files) is refused after its file changed;
    a token cache is rebuilt when the way documents become tokens changes (data.TOKENS_FORMAT)."""
    from affine_attention.train import data
    from affine_attention.train.config import SourceConfig
    from affine_attention.train.pretrained import load_tokenizer

    tok = load_tokenizer("default")
    docs = write_jsonl(tmp_path / "docs.jsonl", ["Some words of a document. " * 4] * 3)
    src = SourceConfig(kind="hub", name="json", paths=[str(docs)])
    stream = data.PackedStream(src, tok, 8, tok.eos_token_id)
    stream.take(2)
    position = stream.state_dict()
    write_jsonl(docs, ["Other words entirely. " * 4] * 3)
    with pytest.raises(ValueError, match="different data source"):
        data.PackedStream(src, tok, 8, tok.eos_token_id).load_state_dict(position)
    files = SourceConfig(kind="files", paths=[str(docs)])
    _, key = data.token_stream(files, tok, str(tmp_path / "tokens"), tok.eos_token_id)
    monkeypatch.setattr(data, "TOKENS_FORMAT", data.TOKENS_FORMAT + 1)
    assert data.token_stream(files, tok, str(tmp_path / "tokens"), tok.eos_token_id)[1] != key


# --- compare guards its own folder -----------------------------------------------------------------------------
def _snapshot(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file() and
            p.name != ".lock"}


def test_compare_refuses_a_different_comparison_in_a_used_folder_changing_nothing(tiny, tmp_path):
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config
    from affine_attention.train.run_dir import RunLock

    def cfg(*extra):
        return load_config("tiny", tiny + ["train.steps=1", "compare.variants=['softmax', 'affine']", *extra])

    root = tmp_path / "cmp"
    compare(cfg(), root, seeds=1, log=lambda m: None)
    before = _snapshot(root)
    for kwargs, extra, match in [
        ({}, ["compare.variants=['softmax', 'sink']"], "already holds a comparison"),
        ({}, ["optim.lr=0.5"], "already holds a comparison"),
        ({"resume": True}, ["optim.lr=0.5"], "optim.lr"),
        ({"resume": True}, ["compare.variants=['softmax', 'sink']"], "variants"),
    ]:
        with pytest.raises(ValueError, match=match):
            compare(cfg(*extra), root, seeds=1, log=lambda m: None, **kwargs)
        assert _snapshot(root) == before, (kwargs, extra)
    with pytest.raises(ValueError, match="seeds"):
        compare(cfg(), root, seeds=2, resume=True, log=lambda m: None)
    held = RunLock(root)  # another compare holds the folder
    try:
        with pytest.raises(ValueError, match="held by another"):
            compare(cfg(), root, seeds=1, resume=True, log=lambda m: None)
    finally:
        held.release()
    assert _snapshot(root) == before
    compare(cfg(), root, seeds=1, resume=True, log=lambda m: None)  # the same comparison resumes


# --- one error line --------------------------------------------------------------------------------------------
def test_a_prepared_manifest_missing_a_key_is_one_error_line_naming_it(tmp_path):
    from affine_attention.train.config_load import load_config
    from affine_attention.train.prepare import prepare

    docs = write_jsonl(tmp_path / "docs.jsonl", ["One document.", "Another one."])
    prepare(load_config("tiny", ["data.train.kind='files'", f"data.train.paths=['{docs}']"]), tmp_path / "p",
            log=lambda m: None)
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    del manifest["shards"]
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(manifest))
    done = cli_in_process(["prepare-data", "--set", "data.train.kind='files'",
                           "--set", f"data.train.paths=['{docs}']", "--out", str(tmp_path / "p")])
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(errors) == 1, done.stderr
    assert "manifest.json" in errors[0] and "'shards'" in errors[0] and "prepare-data" in errors[0]


@pytest.mark.skipif(os.access("/proc/sys", os.W_OK), reason="needs a read-only folder (/proc/sys)")
def test_export_and_prepare_data_into_a_read_only_out_are_one_error_line(four_steps):
    _, run, _ = four_steps
    for args in (["export", "--run", str(run), "--out", "/proc/sys/affine-attention-export"],
                 ["prepare-data", "--out", "/proc/sys/affine-attention-data"]):
        done = cli_in_process(args)
        errors = [line for line in done.stderr.splitlines() if "error:" in line]
        assert done.returncode == 2 and "Traceback" not in done.stderr and len(errors) == 1, done.stderr
        assert "/proc/sys" in errors[0] and "not writable" in errors[0] and "choose a writable --out" in errors[0]


def test_every_manifest_missing_a_key_is_an_error_naming_its_file_and_the_key(four_steps, tmp_path):
    from affine_attention.analysis.compare_run import load_run
    from affine_attention.hf.load import load_model
    from affine_attention.train.teacher_cache import TeacherCache

    _, run, _ = four_steps
    step = run / "checkpoints" / "step-00000002"
    manifest = json.loads((step / "MANIFEST.json").read_text())
    (step / "MANIFEST.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "files"}))
    with pytest.raises(ValueError, match=r"MANIFEST\.json has no 'files' entry"):
        load_model(str(step))
    cache = _teacher_cache(tmp_path / "cache", {"teacher": "t"}, [1], 1.0)
    (cache.dir / "teacher.json").write_text(json.dumps({"vocab_sha256": "x", "vocab_size": 3}))
    with pytest.raises(ValueError, match=r"teacher\.json has no 'logits_dim' entry"):
        cache.teacher_meta()
    (cache.dir / "shards.jsonl").write_text(json.dumps({"sha256": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"shards\.jsonl: line 1 has no 'file' entry"):
        TeacherCache(str(tmp_path / "cache"), {"teacher": "t"})
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "comparison.json").write_text(json.dumps({"variants": ["softmax"], "seeds": 1}))
    with pytest.raises(ValueError, match=r"comparison\.json has no 'runs' entry"):
        load_run(tmp_path / "cmp")
