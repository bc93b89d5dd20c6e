"""The commands the documents tell users to run, read from the documents themselves, so that CI and the tests run a
document's own text and cannot drift from it (tests/documented_commands.py says how each one is checked).

A documented command is a line of a ```bash block in README.md or docs/*.md (a trailing backslash joins the next line,
`#` starts a comment outside quotes), split at ` && ` into the commands it chains. As a script (for .ci/run):
`python3 tests/documented.py line DOC TEXT` prints the one line of DOC's bash blocks that contains TEXT (failing,
with the candidates, when none or several do); `... ci DOC TEXT` prints the commands of that line CI is to run;
`... summary` says, per document, how its commands are run."""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELL_BLOCKS = ("bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Line:
    doc: str       # the document's path relative to the repository, e.g. "README.md"
    lineno: int    # the line the command starts on
    text: str      # the whole logical line, comment stripped: what a user pastes
    commands: tuple[str, ...]  # `text` split at top-level " && "


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _unquoted(text: str):
    """The indices of `text` outside single and double quotes (shlex agrees with bash on what is quoted here)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        else:
            yield i


def _strip_comment(line: str) -> str:
    """The line up to a `#` that starts a comment (not inside quotes, not inside a word like `a#b`)."""
    for i in _unquoted(line):
        if line[i] == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _split_and(text: str) -> tuple[str, ...]:
    """Split at the ` && ` operators outside quotes."""
    parts, start = [], 0
    for i in _unquoted(text):
        if i >= start and text.startswith(" && ", i):
            parts.append(text[start:i].strip())
            start = i + 4
    parts.append(text[start:].strip())
    for p in parts:
        shlex.split(p)  # an unbalanced quote is the document's error: say so here, not as a shell failure in CI
    return tuple(parts)


def lines(doc: Path | None = None) -> list[Line]:
    """Every documented command line, in document order."""
    out = []
    for path in [doc] if doc else documents():
        text = path.read_text(encoding="utf-8")
        for block in _FENCE.finditer(text):
            if block.group(1) not in SHELL_BLOCKS:
                continue
            first = text[:block.start(2)].count("\n") + 1
            pending, start = "", 0
            for offset, raw in enumerate(block.group(2).splitlines()):
                body = _strip_comment(raw)
                if not pending:
                    start = first + offset
                if body.endswith("\\"):
                    pending += body[:-1].rstrip() + " "
                    continue
                full = " ".join((pending + body).split()) if pending else body.strip()
                pending = ""
                if full:
                    out.append(Line(str(path.relative_to(REPO)), start, full, _split_and(full)))
    return out


def commands() -> dict[str, list[Line]]:
    """Each documented command's text -> the lines it appears in."""
    seen: dict[str, list[Line]] = {}
    for ln in lines():
        for c in ln.commands:
            seen.setdefault(c, []).append(ln)
    return seen


def command(text: str) -> str:
    """`text`, after checking that a document tells users to run exactly this command: the way a test runs a
    documented command as written (and fails when the document changes it)."""
    if text not in commands():
        near = [c for c in commands() if c.split()[:2] == text.split()[:2]]
        raise AssertionError(f"no document tells users to run {text!r}; documented commands that start the same: "
                             f"{near or 'none'}")
    return text


def line(doc: str, contains: str) -> str:
    """The one command line of `doc`'s bash blocks that contains `contains`."""
    found = [ln.text for ln in lines(REPO / doc) if contains in ln.text]
    if len(found) != 1:
        raise SystemExit(f"error: {len(found)} command lines of {doc} contain {contains!r} (expected one): {found}")
    return found[0]


def ci_part(doc: str, contains: str) -> str:
    """The commands of that line that tests/documented_commands.py gives to .ci/run, joined with ` && `, in the
    document's order and text (the line's other commands are run by the tests it names)."""
    from documented_commands import CI, HOW

    text = line(doc, contains)
    ours = [c for c in _split_and(text) if isinstance(HOW.get(c), CI)]
    if not ours:
        raise SystemExit(f"error: no command of {doc}'s line {text!r} is CI's to run (tests/documented_commands.py)")
    return " && ".join(ours)


def serve_and_ask(serve: str, ask: str, cwd, start_timeout_s: int = 420) -> tuple[int | str, str]:
    """Run a document's server command and, once its /health answers, its request command, as written, in a network
    namespace of their own (so the document's port is free and nothing outside can answer): (exit code, server log).
    The request's output is in cwd/answer.json. 3: the server exited before it was ready; 4: not ready in time."""
    import os
    import signal
    import subprocess
    from urllib.parse import urlsplit

    address = next(w for w in shlex.split(ask) if w.startswith(("http", "localhost", "127.")))
    url = urlsplit(address if "://" in address else f"http://{address}")  # curl's default scheme
    health = f"{url.scheme}://{url.netloc}/health"
    script = f"""
ip link set lo up
{serve} > server.log 2>&1 &
server=$!
for i in $(seq {start_timeout_s // 2}); do
  curl -sf {health} > /dev/null && break
  kill -0 $server 2> /dev/null || exit 3
  sleep 2
done
curl -sf {health} > /dev/null || exit 4
{ask} > answer.json
status=$?
kill -TERM $server
wait $server
exit $status
"""
    # the environment's own commands first, as in the activated environment the document assumes
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    run = subprocess.Popen(["unshare", "--net", "bash", "-c", script], cwd=cwd, env=env, start_new_session=True,
                           stdin=subprocess.DEVNULL)
    try:
        code: int | str = run.wait(timeout=start_timeout_s + 180)
    except subprocess.TimeoutExpired:
        code = "timed out"
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=30)
    log = Path(cwd, "server.log")
    return code, log.read_text()[-4000:] if log.exists() else ""


def netns_unusable() -> str | None:
    """Why serve_and_ask cannot run here (it needs unshare and ip, as root), or None."""
    import subprocess

    try:
        subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"], check=True, capture_output=True,
                       timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"a network namespace with loopback (unshare --net, ip; root) is not available here: {err}"
    return None


def summary() -> str:
    """Per document: how many of its commands CI runs, tests run, run in a scratch folder, or only parse."""
    from documented_commands import HOW

    rows = ["documented commands, by document: how each is run as written (tests/documented_commands.py)"]
    for path in documents():
        kinds: dict[str, int] = {}
        for ln in lines(path):
            for c in ln.commands:
                kind = type(HOW[c]).__name__ if c in HOW else "UNCLASSIFIED"
                kinds[kind] = kinds.get(kind, 0) + 1
        if kinds:
            rows.append(f"  {path.relative_to(REPO)}: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    return "\n".join(rows)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    if sys.argv[1:] == ["summary"]:
        print(summary())
    elif len(sys.argv) == 4 and sys.argv[1] in ("line", "ci"):
        print((line if sys.argv[1] == "line" else ci_part)(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit("usage: python3 tests/documented.py line|ci DOC TEXT | summary")
