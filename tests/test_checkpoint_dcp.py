"""Sharded (DCP) step checkpoints: a 2-rank FSDP2 run resumed from one continues bitwise as the uninterrupted run and
each rank reads about half the state; a full-format checkpoint of an older run still resumes; a failed write leaves
nothing; `export` writes the transformers folder of a step; the shards record the variant and a load refuses another."""
from __future__ import annotations

import shutil

import pytest
import torch

from test_train_helpers import REPO, cli, read_records, sets, tiny, unfinish  # noqa: F401  (fixture)
from torchrun_helpers import torchrun


def _losses(path):
    return [(r["step"], r["loss"], r["grad_norm"], r["alpha_ma"]) for r in read_records(path)]


def _cut_after_checkpoint(run):
    """What a kill after the step checkpoint leaves: no final/, no result.json (the log is truncated on resume)."""
    unfinish(run)


@pytest.mark.slow
def test_two_rank_fsdp_resume_is_bitwise_and_each_rank_reads_half(tiny, tmp_path):
    args = sets(tiny + ["train.steps=4", "train.global_batch=4", "train.micro_batch=2", "train.parallel='fsdp'",
                        "variant.name='affine'", "train.eval_every=4", "train.checkpoint_every=2"])
    run = tmp_path / "run"
    # Written by the background thread, resumed with synchronous saves (the setting may change on resume).
    torchrun(["-m", "affine_attention.cli", "train", *args, "--set", "train.async_checkpoint=true", "--out", str(run)],
             pythonpath=[str(REPO)])
    uninterrupted = _losses(run / "metrics.jsonl")
    assert sorted(p.name for p in (run / "checkpoints" / "step-00000002" / "state").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    _cut_after_checkpoint(run)
    torchrun(["-m", "affine_attention.cli", "train", *args, "--out", str(run), "--resume"], pythonpath=[str(REPO)])
    assert _losses(run / "metrics.jsonl") == uninterrupted
    (resume,) = read_records(run / "metrics.jsonl", "resume")
    per_rank, total = resume["checkpoint_bytes_read_per_rank"], resume["checkpoint_bytes"]
    assert len(per_rank) == 2 and sum(per_rank) >= total
    assert max(per_rank) <= 0.55 * total, (per_rank, total)  # ~1/world: no rank reads the whole state


def _old_save(self, step, final):
    """What the trainer wrote before sharded checkpoints: the full format for every checkpoint."""
    from affine_attention.train import checkpoint as ckpt
    from affine_attention.train.distributed import full_state

    msd, osd = full_state(self.model, self.optimizer)
    state = {"step": step, "data": self.batches.state_dict(), "wall_time": 0.0, "tokens": self.tokens_seen,
             "config": self.cfg.to_dict(), "variant": self.variant, "world_size": 1}
    target = self.out_dir / "final" if final else self.out_dir / "checkpoints" / ckpt.step_name(step)
    ckpt.save(target, model=self.hf_model, model_sd=msd, optim_sd=osd, tokenizer=self.tok, trainer_state=state)


def test_a_full_format_checkpoint_of_an_older_run_still_resumes(tiny, tmp_path, monkeypatch):
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import Trainer, train

    cfg = load_config("tiny", tiny + ["train.steps=4", "train.checkpoint_every=2", "variant.name='affine'"])
    with monkeypatch.context() as m:
        m.setattr(Trainer, "save", _old_save)
        train(cfg, tmp_path / "run", log=lambda s: None)
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step-00000002" / "model.safetensors").is_file()
    uninterrupted = _losses(run / "metrics.jsonl")
    _cut_after_checkpoint(run)
    said = []
    train(cfg, run, resume=True, log=said.append)
    assert any("resuming from" in s and "step-00000002" in s for s in said), said
    assert _losses(run / "metrics.jsonl") == uninterrupted


def test_a_failed_sharded_write_leaves_the_previous_checkpoint_alone(tiny, tmp_path, monkeypatch):
    from affine_attention.train import checkpoint as ckpt
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    calls = []
    original = ckpt.file_table

    def full_disk(folder, only=None):  # the second save's shards cannot be written out
        if only is not None and any("state" in p.parts for p in only):
            calls.append(folder)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
        return original(folder, only)

    monkeypatch.setattr(ckpt, "file_table", full_disk)
    cfg = load_config("tiny", tiny + ["train.steps=5", "train.checkpoint_every=2", "train.keep_checkpoints=5"])
    with pytest.raises(OSError, match="No space left"):
        train(cfg, tmp_path / "run", log=lambda s: None)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step-00000002"], names  # no temporary folder, the older checkpoint intact
    assert ckpt.verify(tmp_path / "run" / "checkpoints" / "step-00000002") is None


def test_export_writes_the_step_as_a_transformers_folder(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    import affine_attention  # noqa: F401  registers the converted classes
    from affine_attention.train.config_load import load_config
    from affine_attention.train.export import export
    from affine_attention.train.loop import train

    common = tiny + ["variant.name='affine'", "schedule.kind='constant'", "schedule.warmup_steps=0"]
    train(load_config("tiny", common + ["train.steps=4", "train.checkpoint_every=2"]), tmp_path / "long",
          log=lambda s: None)
    # With a constant schedule, step 2 of a 4-step run is the end of a 2-step run.
    train(load_config("tiny", common + ["train.steps=2"]), tmp_path / "short", log=lambda s: None)
    assert export(tmp_path / "long", tmp_path / "out", step=2).name == "step-00000002"
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "short" / "final").state_dict()
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "out")).__name__.startswith("Affine")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    # The loader every command uses reads a step checkpoint as it is, non-persistent buffers (RoPE) included.
    from affine_attention.hf.load import load_model

    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    step = load_model(str(tmp_path / "long" / "checkpoints" / "step-00000002"))
    with torch.no_grad():
        want_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "short" / "final").eval()(ids).logits
        assert torch.equal(step(ids).logits, want_logits)
    with pytest.raises(ValueError, match="exists; choose a new folder"):
        export(tmp_path / "long", tmp_path / "out", step=2)
    with pytest.raises(ValueError, match=r"has no checkpoint of step 3; it has steps \[2, 4\]"):
        export(tmp_path / "long", tmp_path / "other", step=3)
    out = cli(["export", "--run", str(tmp_path / "long"), "--out", str(tmp_path / "final-copy")])
    assert "final" in out.stdout and (tmp_path / "final-copy" / "model.safetensors").is_file()
    assert not (tmp_path / "final-copy" / "optimizer.safetensors").exists()


def test_a_step_checkpoint_records_its_variant_and_refuses_another(tiny, tmp_path):
    """The shards carry the variant spec in their safetensors metadata: loading the checkpoint with an edited
    config.json, or resuming it as another variant, is refused naming both (both loaded silently before)."""
    import json

    from affine_attention.hf.load import load_model
    from affine_attention.hf.sharded import shard_files
    from affine_attention.hf.spec_record import recorded_spec
    from affine_attention.train import checkpoint as ckpt
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    cfg = load_config("tiny", tiny + ["train.steps=2", "variant.name='softmax'"])
    run = tmp_path / "run"
    train(cfg, run, log=lambda s: None)
    step = run / "checkpoints" / "step-00000002"
    assert ckpt.verify(step) is None  # the shards were stamped before they were hashed
    assert [recorded_spec(f)["variant"] for f in shard_files(step)] == ["softmax"]
    # final/ is the model alone: no optimizer, and not a checkpoint a resume reads.
    assert json.loads((run / "final" / "MANIFEST.json").read_text())["format"] == ckpt.EXPORT
    assert not (run / "final" / "optimizer.safetensors").exists()
    assert ckpt.newest_intact(run, log=lambda s: None) == step
    with pytest.raises(ValueError, match=r"weights were saved with \{'options': \{\}, 'variant': 'softmax'\}"):
        train(cfg, run, resume=True, variant="off_by_one", log=lambda s: None)  # parameter-free: the same tensors
    edited = tmp_path / "edited"
    shutil.copytree(step, edited)
    conf = json.loads((edited / "config.json").read_text())
    conf["affine_attention"]["variant"] = "off_by_one"
    (edited / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"config.json's affine_attention is .*'off_by_one'.*saved with .*'softmax'"):
        load_model(str(edited))
    assert type(load_model(str(step))).__name__.startswith("Affine")  # the checkpoint as written loads


def test_the_streamed_export_writes_what_save_pretrained_writes_in_one_file_or_several(tiny, tmp_path):
    """hf.sharded.write_pretrained never builds the model; its folder is the one save_pretrained writes from the built
    model (small files byte for byte, tensors and safetensors metadata equal), and split into files of a bounded
    size it loads to the same weights through transformers' index."""
    import filecmp
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from affine_attention.hf.sharded import load_sharded_model, write_pretrained
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    train(load_config("tiny", tiny + ["variant.name='affine'", "train.steps=2", "model.tie_embeddings=true"]),
          tmp_path / "run", log=lambda s: None)
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    load_sharded_model(step).save_pretrained(tmp_path / "built")
    for name in ("one", "split"):
        (tmp_path / name).mkdir()
    assert write_pretrained(step, tmp_path / "one") == ["model.safetensors"]
    assert write_pretrained(step, tmp_path / "split", 20_000) == [f"model-0000{i}-of-00004.safetensors"
                                                                   for i in range(1, 5)]
    files = sorted(p.name for p in (tmp_path / "built").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "one").iterdir())
    for name in files:
        if name.endswith(".safetensors"):
            built, one = str(tmp_path / "built" / name), str(tmp_path / "one" / name)
            with safe_open(built, "pt") as a, safe_open(one, "pt") as b:
                assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
                assert "lm_head.weight" not in a.keys()  # tied: kept once, under the embedding's name
                assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
        else:
            assert filecmp.cmp(tmp_path / "built" / name, tmp_path / "one" / name, shallow=False), name
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    units = {k.split(".layers.")[1].split(".")[0] for k, f in index["weight_map"].items() if ".layers." in k
             and f == "model-00002-of-00004.safetensors"}
    assert len(units) == 1, index["weight_map"]  # whole decoder layers per file
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "split").state_dict()
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "built").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
