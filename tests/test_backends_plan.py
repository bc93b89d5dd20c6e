"""The dispatch table (`affine-attention backends`, ops/plan.py), planned on a CPU-only machine: on CUDA in bf16,
eager, compiled per decoder block (the mask function eager: padding read once, its runs carried into the graph) and
compiled whole (padding unread), no mask kind falls to the exact T x S path and none to a NaN-poisoned guess; each
row names what the backends above refused."""

import pytest
import torch

from affine_attention import cli
from affine_attention.ops.plan import CASES, MODES, dispatch_table

PADDED = ["padding, right", "padding, left", "padding, both sides", "decoding + padding",
          "decoding + window + padding", "window + left padding"]


@pytest.mark.parametrize("mode", list(MODES))
def test_no_cuda_row_falls_to_exact(mode):
    rows = dispatch_table("cuda", torch.bfloat16, mode)
    assert len(rows) == 2 * len(CASES)
    assert [r for r in rows if r.served_by not in ("sdpa", "cuda_flash", "flex")] == []
    served = {(r.mask, r.lse): r for r in rows}
    for lse in (False, True):
        assert served[("softcap (Gemma 2)", lse)].served_by == "flex"
        assert served[("documents + padding", lse)].served_by == "flex"
        assert served[("window + right padding", lse)].served_by == "flex"
        assert served[("padding, not contiguous", lse)].served_by == "flex"  # never cuda_flash with NaN rows
        assert served[("dense mask", lse)].served_by == "flex"
        assert served[("documents with cu_seq_lens", lse)].served_by == "cuda_flash"
        assert served[("window", lse)].served_by == "cuda_flash"
    # Where the mask function reads the padding (eager, compiled blocks), contiguous padding and windows whose mask is
    # all True reach cuda_flash; traced whole, the runs are unknown and flex serves every key mask.
    known = mode != "model"
    for name in PADDED + ["window + all-True padding"]:
        assert served[(name, True)].served_by == ("cuda_flash" if known else "flex"), (name, mode)
    assert served[("padding, all True (attention_mask of ones)", False)].served_by == ("sdpa" if known else "flex")
    if not known:
        assert "cannot be checked" in dict(served[("padding, left", True)].refused)["cuda_flash"]
    # Documents without cu_seq_lens need a host sync for their segments: compiled, flex.
    assert served[("documents without cu_seq_lens", True)].served_by == ("cuda_flash" if mode == "eager" else "flex")
    # Every backend asked before the one that serves gave its reason, in the dispatcher's order.
    softcap = served[("softcap (Gemma 2)", True)]
    assert [n for n, _ in softcap.refused] == ["sdpa", "cuda_flash"]
    assert all("softcap" in why for _, why in softcap.refused)


def test_on_cpu_the_exact_path_is_named():
    """Planned for CPU, a softcap call goes to exact (no CPU kernel caps), and the table says why."""
    rows = {(r.mask, r.lse): r for r in dispatch_table("cpu", torch.float32)}
    capped = rows[("softcap (Gemma 2)", True)]
    assert capped.served_by == "exact"
    assert dict(capped.refused)["flex"].startswith("runs on CUDA only")
    with pytest.raises(ValueError, match="mode must be one of"):
        dispatch_table("cuda", torch.bfloat16, "compiled")


def test_backends_command_prints_the_table(capsys):
    assert cli.main(["backends", "--device", "cuda", "--dtype", "bfloat16", "--compiled"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("cuda bfloat16, compiled per decoder block")
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| mask | variants | served by | refused before it |"
    assert len(lines) == 1 + 2 * len(CASES) and "`exact`" not in text
    assert any(ln.startswith("| softcap (Gemma 2) |") and "sink" in ln and "`flex`" in ln for ln in lines)


@pytest.mark.parametrize("compiled", [[], ["--compiled"], ["--compiled", "model"]], ids=list(MODES))
def test_docs_show_the_current_dispatch_table(capsys, compiled):
    from pathlib import Path

    argv = ["backends", "--device", "cuda", "--dtype", "bfloat16"] + compiled
    assert cli.main(argv) == 0
    table = capsys.readouterr().out.strip()
    docs = (Path(__file__).parents[1] / "docs" / "kernels.md").read_text()
    assert table in docs, f"docs/kernels.md's dispatch table is stale: paste `affine-attention {' '.join(argv)}`"


def test_a_device_is_planned_for_its_type_and_an_unknown_one_is_refused(capsys):
    """`cuda:0` is planned as cuda (it was once planned as no CUDA device: every CUDA backend refused it); a string
    that names no device type the backends tell apart is one error line, not an rc-0 table."""
    assert dispatch_table("cuda:0", torch.bfloat16) == dispatch_table("cuda", torch.bfloat16)
    assert cli.main(["backends", "--device", "cuda:0"]) == 0
    assert capsys.readouterr().out.startswith("cuda bfloat16, eager")
    for bad in ("foo", "meta", "cuda:x"):
        assert cli.main(["backends", "--device", bad]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.strip() == (f"affine-attention backends: error: device {bad!r} cannot be planned for: use "
                                        "one of cpu, cuda (an index such as cuda:0 is allowed; the plan is the same "
                                        "for every device of a type)")
