"""Prepared token shards: `prepare-data` writes the in-memory path's token stream (so training reads the same
sequences), each rank reads only its own rows of the same global batch for any world size, a cursor resumes exactly,
an interrupted preparation continues, and a wrong tokenizer or a damaged shard is refused naming the file."""
from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch

from affine_attention.train import shards as shards_mod
from affine_attention.train.config import DataConfig, SourceConfig
from affine_attention.train.config_load import load_config
from affine_attention.train.data import TrainBatches, open_source
from affine_attention.train.prefetch import Prefetcher
from affine_attention.train.prepare import prepare
from affine_attention.train.shards import TokenSource
from test_train_helpers import read_records, sets, tiny, tok, unfinish, write_jsonl  # noqa: F401  (fixtures)

SHARD_DOCS = 7  # 40 documents -> 6 shards, so some sequences span two shards


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory):
    docs = [f"Document number {i}. " + "To be or not to be, that is the question. " * (2 + i % 7) for i in range(40)]
    return write_jsonl(tmp_path_factory.mktemp("docs") / "docs.jsonl", docs)


def _cfg(docs_file, *extra):
    return load_config("tiny", ["data.train.kind='files'", f"data.train.paths=['{docs_file}']", "data.seq_len=16",
                                *extra])


@pytest.fixture(scope="module")
def prepared(docs_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "p"
    prepare(_cfg(docs_file), out, shard_documents=SHARD_DOCS, log=lambda m: None)
    return out


def _tokens(folder, tok, seed=0, shuffle=True, seq_len=16):
    return TokenSource(folder, tok, tok.eos_token_id, seq_len, seed, shuffle)


def test_prepared_shards_give_the_in_memory_sequences_in_the_same_order(tok, docs_file, prepared, tmp_path):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["complete"] and manifest["dtype"] == "uint16" and len(manifest["shards"]) == 6
    memory = open_source(SourceConfig(kind="files", paths=[str(docs_file)]), tok,
                         DataConfig(seq_len=16, token_cache_dir=str(tmp_path)), seed=5, shuffle=True)
    source = _tokens(prepared, tok, seed=5)
    assert source.n == memory.n and len(source.shards_of(np.arange(source.n))) == 6
    rows, ids = source.take(source.n + 9)  # into a second epoch
    ref_rows, ref_ids = memory.take(memory.n + 9)
    assert torch.equal(ids, ref_ids) and torch.equal(rows, ref_rows)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_reads_only_its_rows_and_the_ranks_form_the_single_process_batch(tok, prepared, world):
    single = TrainBatches(_tokens(prepared, tok), 8, 8, 0, 1)
    expected = [single.next() for _ in range(6)]
    single.close()
    m = 8 // world
    for rank in range(world):
        source, read = _tokens(prepared, tok), []
        rows_of = source.rows
        source.rows = lambda ids, f=rows_of, read=read: (read.append(ids.tolist()), f(ids))[1]
        batches = TrainBatches(source, 8, m, rank, world)
        got = [batches.next() for _ in range(3)]
        batches.close()
        for step, (rows, ids) in enumerate(got):  # the rank's slice of the single-process batch
            assert torch.equal(ids, expected[step][1][rank * m:(rank + 1) * m])
            assert torch.equal(rows, expected[step][0][rank * m:(rank + 1) * m])
        # every read (the prefetch thread reads ahead) asked for this rank's rows of one step, nothing else
        assert 3 <= len(read) <= 6
        assert read == [expected[s][1][rank * m:(rank + 1) * m].tolist() for s in range(len(read))]


def test_a_saved_cursor_resumes_exactly(tok, prepared):
    full = TrainBatches(_tokens(prepared, tok, seed=2), 8, 4, 0, 1)
    whole = [full.next() for _ in range(5)]
    first = TrainBatches(_tokens(prepared, tok, seed=2), 8, 4, 0, 1)
    part = [first.next() for _ in range(2)]
    while first.prefetch._queue.qsize() < 2:  # let the thread read 2 batches ahead, as it does during a step
        time.sleep(0.01)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    first.close()
    assert state["kind"] == "tokens" and state["position"] == 16
    resumed = TrainBatches(_tokens(prepared, tok, seed=2), 8, 4, 0, 1)
    resumed.load_state_dict(state)
    got = part + [resumed.next() for _ in range(3)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, whole))
    with pytest.raises(ValueError, match="different data"):
        TrainBatches(_tokens(prepared, tok, seq_len=8), 8, 4, 0, 1).load_state_dict(state)


def test_an_interrupted_preparation_keeps_its_finished_shards_and_continues(docs_file, prepared, tmp_path,
                                                                             monkeypatch):
    out, written = tmp_path / "p", []
    real = shards_mod.write_shard

    def dies_at_shard_3(folder, k, tokens, ends):
        if k == 3 and not written.count(3):
            written.append(3)
            raise KeyboardInterrupt  # a kill between shards
        written.append(k)
        return real(folder, k, tokens, ends)

    monkeypatch.setattr("affine_attention.train.prepare.write_shard", dies_at_shard_3)
    with pytest.raises(KeyboardInterrupt):
        prepare(_cfg(docs_file), out, shard_documents=SHARD_DOCS, log=lambda m: None)
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    (out / "shard-00001.npy").write_bytes(b"x" + (out / "shard-00001.npy").read_bytes()[1:])  # damaged meanwhile
    said = []
    prepare(_cfg(docs_file), out, shard_documents=SHARD_DOCS, log=said.append)
    assert written == [0, 1, 2, 3, 1, 2, 3, 4, 5]  # shard 0 kept; from the damaged shard 1 on, written again
    assert any("shard-00001.npy does not match its sha256" in m for m in said), said
    assert json.loads((out / "manifest.json").read_text()) == json.loads((prepared / "manifest.json").read_text())
    with pytest.raises(ValueError, match="prepared with other settings .*shard_documents"):
        prepare(_cfg(docs_file), out, shard_documents=5, log=lambda m: None)


def test_a_hub_stream_prepares_to_the_same_shards(docs_file, prepared, tmp_path):
    cfg = load_config("tiny", ["data.train.kind='hub'", "data.train.name='json'", f"data.train.paths=['{docs_file}']",
                               "data.seq_len=16"])  # datasets' json builder, streamed offline: the hub code path
    said = []
    manifest = prepare(cfg, tmp_path / "hub", shard_documents=SHARD_DOCS, log=said.append)
    files = json.loads((prepared / "manifest.json").read_text())
    assert [s["file"]["sha256"] for s in manifest["shards"]] == [s["file"]["sha256"] for s in files["shards"]]
    assert manifest["source"]["kind"] == "hub" and any("6 shards" in m for m in said)


def test_a_different_tokenizer_or_separator_is_refused_naming_the_manifest(tok, prepared):
    from affine_attention.train.pretrained import load_tokenizer

    other = load_tokenizer("backcopy:random:8")
    with pytest.raises(ValueError, match=f"{prepared / 'manifest.json'}: prepared with tokenizer 'default'"):
        TokenSource(prepared, other, other.eos_token_id, 16, 0, True)
    with pytest.raises(ValueError, match="separator id 0, the run uses 1"):
        TokenSource(prepared, tok, 1, 16, 0, True)


def test_a_truncated_or_damaged_shard_is_refused_naming_the_file(tok, prepared, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(prepared, folder)
    shard = folder / "shard-00002.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    with pytest.raises(ValueError, match=f"{shard} has {len(data) - 2} bytes.*prepare-data --config"):
        _tokens(folder, tok)
    shard.write_bytes(data[:-2] + bytes([data[-2] ^ 1, data[-1]]))  # same size, one bit flipped
    _tokens(folder, tok)  # sizes are checked at every open, checksums once per run start (TrainBatches)
    TrainBatches(_tokens(folder, tok), 8, 4, 1, 2)  # rank 1 of 2 hashes shards 1, 3, 5 only
    with pytest.raises(ValueError, match=f"{shard} does not match its sha256.*prepare-data"):
        TrainBatches(_tokens(folder, tok), 8, 4, 0, 2)
    with pytest.raises(ValueError, match="unfinished"):
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
        _tokens(folder, tok)


def test_the_prefetch_thread_raises_in_the_caller_and_saves_the_used_position():
    calls = []

    def produce():
        calls.append(len(calls))
        if len(calls) == 4:
            raise OSError("disk gone")
        return calls[-1]

    p = Prefetcher(produce, lambda: {"position": len(calls)}, depth=2)
    assert p.state_dict() == {"position": 0}
    assert p.next() == 0 and p.state_dict() == {"position": 1}  # read ahead, but only one batch used
    assert p.next() == 1 and p.next() == 2
    with pytest.raises(OSError, match="disk gone"):
        p.next()
    assert p._thread is None  # stopped: nothing left running after the error


def test_a_tokens_source_needs_one_folder():
    with pytest.raises(ValueError, match=r"data.train.kind = 'tokens' needs data.train.paths = \[the folder"):
        load_config("tiny", ["data.train.kind='tokens'"])


def test_prepare_data_then_train_reads_the_same_batches_as_the_in_memory_run_and_resumes(tiny, tmp_path):
    from affine_attention.cli import main

    common = tiny + ["train.steps=4", "train.checkpoint_every=2", "variant.name='affine'"]
    prep, ref, run = tmp_path / "prep", tmp_path / "ref", tmp_path / "run"
    assert main(["prepare-data", *sets(common), "--out", str(prep), "--workers", "1"]) == 0
    tokens = common + ["data.train.kind='tokens'", f"data.train.paths=['{prep}']"]
    assert main(["train", *sets(common), "--out", str(ref)]) == 0  # the in-memory files source
    assert main(["train", *sets(tokens), "--out", str(run)]) == 0
    losses = [(r["step"], r["loss"], r["grad_norm"]) for r in read_records(ref / "metrics.jsonl")]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_records(run / "metrics.jsonl")] == losses
    # What a kill after the step-2 checkpoint leaves; the resume continues from the cursor to the same losses.
    unfinish(run)
    assert main(["train", *sets(tokens), "--out", str(run), "--resume"]) == 0
    assert [r["step"] for r in read_records(run / "metrics.jsonl", "resume")] == [2]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_records(run / "metrics.jsonl")] == losses


@pytest.mark.slow  # about 7 s: two spawned workers import transformers
def test_worker_processes_write_the_same_shards(docs_file, prepared, tmp_path):
    prepare(_cfg(docs_file), tmp_path / "w2", workers=2, shard_documents=SHARD_DOCS, log=lambda m: None)
    assert (json.loads((tmp_path / "w2" / "manifest.json").read_text())
            == json.loads((prepared / "manifest.json").read_text()))


@pytest.mark.slow  # about 20 s: torchrun with 2 gloo processes
def test_two_ranks_on_prepared_shards_follow_the_single_process_run(tiny, tmp_path):
    from affine_attention.cli import main
    from test_train_helpers import REPO
    from torchrun_helpers import torchrun

    prep = tmp_path / "prep"
    assert main(["prepare-data", *sets(tiny), "--out", str(prep), "--workers", "1"]) == 0
    common = tiny + ["train.steps=3", "train.global_batch=8", "data.train.kind='tokens'",
                     f"data.train.paths=['{prep}']"]
    assert main(["train", *sets(common + ["train.micro_batch=4"]), "--out", str(tmp_path / "one")]) == 0
    torchrun(["-m", "affine_attention.cli", "train", *sets(common + ["train.micro_batch=2"]), "--out",
              str(tmp_path / "two")], pythonpath=[str(REPO)])
    one, two = (read_records(tmp_path / d / "metrics.jsonl") for d in ("one", "two"))
    assert [r["step"] for r in two] == [1, 2, 3]
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 for a, b in zip(one, two))


def test_the_embedded_corpus_prepares_offline(tok, tmp_path):
    from affine_attention.train.data import eval_sequences

    cfg = load_config("tiny", [f"data.token_cache_dir='{tmp_path / 'cache'}'"])
    prepare(cfg, tmp_path / "val", which="eval", log=lambda m: None)  # the 4 held-out works: one shard
    n = open_source(cfg.data.eval, tok, cfg.data, 0, shuffle=False).n  # every sequence, not just the first work's
    got = eval_sequences(SourceConfig(kind="tokens", paths=[str(tmp_path / "val")]), tok, cfg.data, n)
    assert torch.equal(got, eval_sequences(cfg.data.eval, tok, cfg.data, n))
    with pytest.raises(ValueError, match="holds only"):
        eval_sequences(SourceConfig(kind="tokens", paths=[str(tmp_path / "val")]), tok, cfg.data, n + 1)


@pytest.mark.parametrize("out, match", [("", "--out is empty"), ("afile", "is an existing file, not a folder")])
def test_a_bad_out_is_one_error_line_before_any_work(out, match, tmp_path, monkeypatch):
    """`--out ""` once prepared into the current folder; `--out FILE` ended in a FileExistsError traceback."""
    from test_train_helpers import cli_in_process

    monkeypatch.chdir(tmp_path)  # where an empty --out would write
    (tmp_path / "afile").write_text("x")
    done = cli_in_process(["prepare-data", "--out", str(tmp_path / out) if out else ""])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if "error:" in line and match in line], done.stderr
