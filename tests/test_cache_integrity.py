"""Every on-disk cache is checked before use (issue 33, item 5): a teacher-cache shard whose data changed is an
error naming the file and how to rebuild it; a truncated or altered token cache is rebuilt with a notice naming it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from affine_attention.train.teacher_cache import TeacherCache


def _cache_with_one_shard(root, dtype=torch.float16):
    cache = TeacherCache(str(root), {"teacher": "t", "k": 3}, shard_sequences=2)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2, 5, 3, generator=gen).to(dtype)
    indices = torch.randint(0, 50, (2, 5, 3), generator=gen)
    cache.put([7, 9], values, indices)  # two pending: written out as one shard
    (shard,) = cache.dir.glob("shard-*.safetensors")
    return cache, shard, values


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_an_intact_teacher_shard_reads_back(tmp_path, dtype):
    _, _, values = _cache_with_one_shard(tmp_path, dtype)
    got = TeacherCache(str(tmp_path), {"teacher": "t", "k": 3}).get([9, 7])
    assert torch.equal(got[0][0], values[1]) and torch.equal(got[1][0], values[0])


def test_a_teacher_shard_whose_values_were_overwritten_is_an_error_naming_it(tmp_path):
    _, shard, _ = _cache_with_one_shard(tmp_path)
    with safe_open(str(shard), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
        meta = f.metadata()
    tensors["values"][1, 2, 0] += 1  # the case: values changed, everything else (and the metadata) kept
    save_file(tensors, str(shard), metadata=meta)
    fresh = TeacherCache(str(tmp_path), {"teacher": "t", "k": 3})
    with pytest.raises(ValueError, match=rf"{shard}.*fails its checksum.*delete it and rerun"):
        fresh.get([7])


def test_a_teacher_shard_without_a_checksum_is_an_error(tmp_path):
    _, shard, _ = _cache_with_one_shard(tmp_path)
    with safe_open(str(shard), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match="has no checksum"):
        TeacherCache(str(tmp_path), {"teacher": "t", "k": 3}).get([9])


def _token_stream(tmp_path):
    from affine_attention.train.config import SourceConfig
    from affine_attention.train.data import token_stream
    from affine_attention.train.pretrained import load_tokenizer

    (tmp_path / "a.txt").write_text("Some words to tokenise, and then a few more of them.\n" * 20)
    src = SourceConfig(kind="files", paths=[str(tmp_path / "a.txt")])
    return lambda: token_stream(src, load_tokenizer("default"), str(tmp_path / "tokens"), 0)


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "no_checksum"])
def test_a_damaged_token_cache_is_rebuilt_with_a_notice_naming_it(tmp_path, capsys, damage):
    stream = _token_stream(tmp_path)
    want, key = stream()
    path = tmp_path / "tokens" / f"{key}.npy"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "overwrite":
        arr = np.load(path)
        arr[3] += 1
        np.save(path, arr)
    else:
        path.with_suffix(".sha256").unlink()
    capsys.readouterr()
    got, _ = stream()
    assert np.array_equal(got, want)
    assert f"token cache {path} is unusable" in capsys.readouterr().err
    stream()  # rebuilt with its checksum: read silently now
    assert capsys.readouterr().err == ""
