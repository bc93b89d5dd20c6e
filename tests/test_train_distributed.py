"""torchrun with 2 gloo processes (DDP and FSDP2) follows the single-process loss trajectory for the same global
batch and ends with identical alpha_ma on both ranks (about 20 s on 2 idle cores, so not marked slow)."""
from __future__ import annotations

import json
import subprocess

from test_train_helpers import REPO, cli, read_records, sets, tiny  # noqa: F401  (fixture)
from torchrun_helpers import torchrun


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    return torchrun(["-m", "affine_attention.cli", *args], pythonpath=[str(REPO)])


def test_ddp_and_fsdp_follow_single_process(tiny, tmp_path):
    common = tiny + ["train.steps=5", "train.global_batch=8", "variant.name='affine'", "train.eval_every=5"]
    # One process with micro_batch 4 runs the same forward rounds as 2 ranks with micro_batch 2 (data.TrainBatches).
    cli(["train", *sets(common + ["train.micro_batch=4"]), "--out", str(tmp_path / "single")])
    ref = read_records(tmp_path / "single" / "metrics.jsonl")
    for parallel in ("ddp", "fsdp"):
        out = tmp_path / parallel
        _torchrun(["train", *sets(common + ["train.micro_batch=2", f"train.parallel='{parallel}'"]), "--out", str(out)])
        got = read_records(out / "metrics.jsonl")
        assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
        for a, b in zip(got, ref):
            assert abs(a["loss"] - b["loss"]) <= 1e-5, (parallel, a["step"], a["loss"], b["loss"])
            assert max(abs(x - y) for x, y in zip(a["alpha_ma"], b["alpha_ma"])) <= 1e-5
        result = json.loads((out / "result.json").read_text())
        assert result["world_size"] == 2 and result["running_stats_max_rank_diff"] == 0.0
        assert abs(result["heldout_loss"] - json.loads((tmp_path / "single" / "result.json").read_text())
                   ["heldout_loss"]) <= 1e-5
        assert (out / "final" / "model.safetensors").is_file()
