"""Start `torchrun` with 2 CPU (gloo) processes for a test; on a hang, every process prints its Python stacks."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

# A tiny run takes seconds; a hang is a bug, so it is cut well before CI's own limits and shows where it stood.
HANG_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own, out of reach of killpg)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _signal(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def torchrun(args: list[str], *, pythonpath: list[str], timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node 2 ARGS`; asserts it exits 0 and returns its output.

    On a timeout the workers, then the launcher, get SIGABRT, which faulthandler turns into a dump of every
    thread's stack; the assertion message carries it.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": os.pathsep.join(pythonpath)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs = _descendants(proc.pid)
        _signal(procs, signal.SIGABRT)
        time.sleep(2)  # the workers' dumps first: the launcher's death would close their stderr
        _signal([proc.pid], signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _signal([proc.pid, *procs], signal.SIGKILL)
            stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun hung for {timeout:.0f} s; the stacks at that moment are at the end of its "
                             f"stderr\n{' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr[-20000:]}") from None
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{stdout}\n{stderr}"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
