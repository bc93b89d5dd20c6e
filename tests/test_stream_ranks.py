"""Hub streams under several ranks: each rank streams, packs and resumes only its own documents, with sequence ids
unique over the ranks, and a checkpoint's position is refused by a run with another number of ranks."""
from __future__ import annotations

import json

import pytest
import torch

from affine_attention.train.config import SourceConfig
from affine_attention.train.data import PackedStream, TrainBatches, documents, tokenize_documents
from test_train_helpers import read_records, sets, tiny, tok, unfinish, write_jsonl  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def hub_src(tmp_path_factory):
    docs = [f"Document {i}. " + "Now is the winter of our discontent. " * (1 + i % 4) for i in range(100)]
    path = write_jsonl(tmp_path_factory.mktemp("docs") / "docs.jsonl", docs)  # > 32 documents (one read) per rank
    return SourceConfig(kind="hub", name="json", paths=[str(path)], split="train"), docs  # streamed, offline


def test_each_rank_streams_its_own_documents_with_ids_unique_over_ranks(tok, hub_src):
    src, docs = hub_src
    mine = [list(documents(src, rank=r, world=2)) for r in range(2)]
    assert sorted(mine[0] + mine[1]) == sorted(docs) and not set(mine[0]) & set(mine[1])
    ids = []
    for rank in range(2):
        stream = PackedStream(src, tok, 16, tok.eos_token_id)
        stream.split_by_rank(rank, 2)
        rows, got = stream.take(6)
        ids.append(got.tolist())
        own = [t for x in tokenize_documents(tok, mine[rank], tok.eos_token_id) for t in x]
        assert rows[:, :-1].flatten().tolist() == own[:6 * 16]  # packed from this rank's documents only
    assert ids == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]


def test_a_rank_resumes_its_own_stream_exactly(tok, hub_src):
    src, _ = hub_src

    def rank1():
        stream = PackedStream(src, tok, 16, tok.eos_token_id)
        stream.split_by_rank(1, 2)
        return stream

    whole = rank1().take(100)[0]
    first = rank1()
    part = first.take(20)[0]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["docs"] == 32 and state["buffer"]  # mid-stream: the next documents are still to be read
    resumed = rank1()
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([part, resumed.take(80)[0]]), whole)


def test_a_position_saved_by_other_ranks_is_refused(tok, hub_src):
    src, _ = hub_src
    one = TrainBatches(PackedStream(src, tok, 16, tok.eos_token_id), 4, 4, 0, 1)
    state = one.state_dict()
    two = TrainBatches(PackedStream(src, tok, 16, tok.eos_token_id), 4, 2, 0, 2)
    with pytest.raises(ValueError, match="saved by 1 rank.*this run has 2.*same number of ranks"):
        two.load_state_dict(state)
    with pytest.raises(ValueError, match="saved by 4 rank.*this run has 2"):
        two.load_state_dict({"kind": "ranks", "world": 4, "ranks": [state] * 4})


@pytest.mark.slow  # about 40 s: three torchrun runs of 2 gloo processes
def test_two_ranks_on_a_hub_stream_resume_to_the_same_losses(tiny, tmp_path):
    from test_train_helpers import REPO
    from torchrun_helpers import torchrun

    train = [a for a in tiny if a.startswith("data.train.paths")][0].split("=", 1)[1]
    common = tiny + ["train.steps=4", "train.global_batch=4", "train.micro_batch=2", "train.checkpoint_every=2",
                     "data.train.kind='hub'", "data.train.name='json'", f"data.train.paths={train}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    for out in (ref, run):
        torchrun(["-m", "affine_attention.cli", "train", *sets(common), "--out", str(out)], pythonpath=[str(REPO)])
    unfinish(run)  # what a kill after the step-2 checkpoint leaves
    torchrun(["-m", "affine_attention.cli", "train", *sets(common), "--out", str(run), "--resume"],
             pythonpath=[str(REPO)])
    assert [r["step"] for r in read_records(run / "metrics.jsonl", "resume")] == [2]
    losses = [(r["step"], r["loss"]) for r in read_records(ref / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in read_records(run / "metrics.jsonl")] == losses
