"""Whether a vLLM release has every symbol, parameter and attribute the serving plugin uses, read from its Python
sources without importing them (so the CUDA `vllm` wheel is checked on a CPU machine, where it cannot import).

What the plugin needs is read from its own source (affine_attention/serving/*.py): every name it imports from vllm,
the keywords and positional arguments of each call to one, the methods it calls on one, the attributes it reads from a
parameter annotated with one, and the model classes of SERVED with the layer path it walks. What a release has is a
snapshot of the modules that check touches: top-level functions with their parameters, classes with their bases,
methods and the attributes their methods assign, values and re-exports.

    python scripts/vllm_api.py snapshot --wheel vllm-0.34.0-....whl --out tests/vllm_api/vllm-0.34.0.json
    python scripts/vllm_api.py check tests/vllm_api/vllm-0.34.0.json     # or --installed: the vllm on sys.path
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
import zipfile
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1] / "affine_attention" / "serving"
#: The path the plugin walks from a served model to each layer's attention (vllm_model.AffineServingMixin), and the
#: argument of the attention module's forward it captures (vllm_model._CaptureInput).
LAYER_PATH, CAPTURED = ("model", "layers", "self_attn", "attn"), "hidden_states"


# ---- what the plugin needs ------------------------------------------------------------------------------------------
def requirements(plugin: Path = PLUGIN) -> list[dict]:
    """Each need: {"where": "file:line", "module", "name", and one of "call" (keywords, positional count),
    "method" (name, keywords), "attr" (name), or "family_class"}."""
    needs: list[dict] = []
    for path in sorted(plugin.glob("vllm*.py")):
        tree = ast.parse(path.read_text(), str(path))
        local: dict[str, tuple[str, str]] = {}  # local name -> (vllm module, name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and not node.level and node.module
                    and node.module.split(".")[0] == "vllm"):
                for a in node.names:
                    local[a.asname or a.name] = (node.module, a.name)
                    needs.append(_need(path, node, node.module, a.name))
        # `f(**extra)`: the keys of the dict literals the file assigns to `extra`
        spread = {t.id: {ast.literal_eval(k) for k in v.keys if isinstance(k, ast.Constant)}
                  for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  for t, v in _pairs(node) if isinstance(t, ast.Name) and isinstance(v, ast.Dict)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in local:
                    named = {k.arg for k in node.keywords if k.arg}
                    named |= {key for k in node.keywords if not k.arg and isinstance(k.value, ast.Name)
                              for key in spread.get(k.value.id, ())}
                    needs.append(_need(path, node, *local[f.id], call={
                        "keywords": sorted(named),
                        "positional": sum(not isinstance(a, ast.Starred) for a in node.args)}))
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in local:
                    needs.append(_need(path, node, *local[f.value.id], method={
                        "name": f.attr, "keywords": sorted(k.arg for k in node.keywords if k.arg)}))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                typed = {a.arg: local[a.annotation.id] for a in node.args.args
                         if isinstance(a.annotation, ast.Name) and a.annotation.id in local}
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id in typed and isinstance(sub.ctx, ast.Load)):
                        needs.append(_need(path, sub, *typed[sub.value.id], attr=sub.attr))
        for node in tree.body:  # SERVED = {family: (module, class)}: vLLM's model classes the plugin extends
            if isinstance(node, ast.AnnAssign | ast.Assign) and "SERVED" in [
                    getattr(t, "id", None) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]:
                for module, cls in ast.literal_eval(node.value).values():
                    needs.append(_need(path, node, f"vllm.model_executor.models.{module}", cls, family_class=True))
    unique = {json.dumps(n, sort_keys=True): n for n in needs}
    return list(unique.values())


def _pairs(node: ast.Assign):
    """(target, value) pairs of `a = x` and `a, b = x, y`."""
    for t in node.targets:
        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
            yield from zip(t.elts, node.value.elts)
        else:
            yield t, node.value


def _need(path: Path, node: ast.AST, module: str, name: str, **what) -> dict:
    return {"where": f"{path.name}:{node.lineno}", "module": module, "name": name, **what}


# ---- what a release has ---------------------------------------------------------------------------------------------
def _params(fn: ast.FunctionDef) -> dict:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    return {"params": names, "kwonly": [x.arg for x in a.kwonlyargs], "varargs": a.vararg is not None,
            "varkw": a.kwarg is not None}


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node)


def summarise(source: str, module: str) -> dict:
    """One module's top-level names -> what they are (see the module docstring)."""
    tree, out = ast.parse(source), {}
    package = module[: -len(".__init__")] if module.endswith(".__init__") else module.rsplit(".", 1)[0]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = {"kind": "function", **_params(node)}
        elif isinstance(node, ast.ClassDef):
            methods = {m.name: _params(m) for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
            attrs = {t.attr for m in ast.walk(node) if isinstance(m, (ast.Assign, ast.AnnAssign))
                     for t in (m.targets if isinstance(m, ast.Assign) else [m.target])
                     for t in ast.walk(t) if isinstance(t, ast.Attribute) and _dotted(t.value) == "self"}
            attrs |= {t.id for m in node.body if isinstance(m, (ast.Assign, ast.AnnAssign))
                      for t in (m.targets if isinstance(m, ast.Assign) else [m.target]) if isinstance(t, ast.Name)}
            out[node.name] = {"kind": "class", "bases": [_dotted(b) for b in node.bases], "methods": methods,
                              "attrs": sorted(attrs)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            callee = _dotted(value.func) if isinstance(value, ast.Call) else None
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = {"kind": "value", "call": callee}
                    if t.id == "MODULE_ATTRS" and isinstance(value, ast.Dict):  # vllm/__init__'s lazy exports
                        for k, v in zip(value.keys, value.values):
                            mod, name = ast.literal_eval(v).split(":")
                            out[ast.literal_eval(k)] = {"kind": "import", "from": "vllm" + mod, "name": name}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                if a.name == "*":  # resolved name by name through the star's modules
                    out.setdefault("*", {"kind": "star", "from": []})["from"].append(base)
                else:
                    out.setdefault(a.asname or a.name, {"kind": "import", "from": base, "name": a.name})
    return out


class Release:
    """The modules of one vLLM release, read on demand from its sources (a folder holding `vllm/`, or a wheel),
    or from a snapshot file; `touched` keeps what a check read, which is what a snapshot records."""

    def __init__(self, root: Path | None = None, wheel: Path | None = None, snapshot: dict | None = None):
        self.root, self.zip = root, zipfile.ZipFile(wheel) if wheel else None
        self.snapshot, self.touched = snapshot, {}
        self.version = snapshot["version"] if snapshot else self._version()

    def _read(self, rel: str) -> str | None:
        if self.zip:
            try:
                return self.zip.read(rel).decode()
            except KeyError:
                return None
        p = self.root / rel
        return p.read_text() if p.is_file() else None

    def _version(self) -> str:
        found = re.search(r"^__version__\b.*?=\s*['\"]([^'\"]+)['\"]", self._read("vllm/_version.py") or "", re.M)
        return found.group(1) if found else "unknown"

    def module(self, name: str, probe: bool = False) -> dict | None:
        """The module's summary, None where the release has no such module. probe: a guess (is this name a
        submodule?), which a snapshot that never recorded it answers with None instead of an error."""
        if name not in self.touched:
            if self.snapshot is not None:
                if probe and name not in self.snapshot["modules"]:
                    return None
                self.touched[name] = self.snapshot["modules"].get(name, "missing")
            else:
                rel = name.replace(".", "/")
                text = self._read(rel + ".py")
                key = name
                if text is None:
                    text, key = self._read(rel + "/__init__.py"), name + ".__init__"
                self.touched[name] = summarise(text, key) if text is not None else None
        got = self.touched[name]
        if got == "missing":
            raise LookupError(f"module {name} is not in the snapshot: re-take it with scripts/vllm_api.py snapshot")
        return got

    def resolve(self, module: str, name: str, hops: int = 8) -> tuple[str, dict] | None:
        """(defining module, its entry) for `module.name`, following re-exports; None if absent."""
        for _ in range(hops):
            summary = self.module(module) or {}
            entry = summary.get(name)
            if entry is None and "*" in summary:
                for star in summary["*"]["from"]:
                    found = self.resolve(star, name, hops - 1) if star.startswith("vllm") else None
                    if found:
                        return found
            if entry is None:
                sub = self.module(f"{module}.{name}", probe=True)  # `from vllm.x import submodule`
                return (f"{module}.{name}", {"kind": "module"}) if sub is not None else None
            if entry["kind"] != "import" or not entry["from"].startswith("vllm"):
                return module, entry
            module, name = entry["from"], entry["name"]
        return None

    def class_chain(self, module: str, entry: dict) -> list[dict]:
        """The class and its bases defined in vLLM (depth first), for inherited methods and attributes."""
        chain, todo = [], [(module, entry)]
        while todo:
            mod, e = todo.pop(0)
            chain.append(e)
            for base in e.get("bases", []):
                found = self.resolve(mod, base.split(".")[-1]) if "." not in base else None
                if found and found[1]["kind"] == "class":
                    todo.append(found)
        return chain


# ---- the check ------------------------------------------------------------------------------------------------------
def check(release: Release, needs: list[dict]) -> list[str]:
    """Problems: each need this release does not meet, said with where the plugin needs it."""
    problems = []
    for n in needs:
        what = f"{n['where']}: {n['module']}.{n['name']}"
        found = release.resolve(n["module"], n["name"])
        if found is None:
            problems.append(f"{what} does not exist in vLLM {release.version}")
            continue
        mod, entry = found
        if "call" in n:
            problems += [f"{what}: {p}" for p in _call_problems(release, mod, entry, n["call"])]
        if "method" in n:
            cls = _class_of_value(release, mod, entry)
            methods = {} if cls is None else {k: v for c in release.class_chain(*cls) for k, v in c["methods"].items()}
            sig = methods.get(n["method"]["name"])
            if sig is None:
                problems.append(f"{what} has no method {n['method']['name']!r} in vLLM {release.version}")
            else:
                problems += [f"{what}.{n['method']['name']}: {p}"
                             for p in _keyword_problems(sig, n["method"]["keywords"])]
        if "attr" in n:
            chain = release.class_chain(mod, entry) if entry["kind"] == "class" else []
            known = {a for c in chain for a in c["attrs"]} | {m for c in chain for m in c["methods"]}
            if n["attr"] not in known:
                problems.append(f"{what} instances have no attribute {n['attr']!r} in vLLM {release.version}")
        if n.get("family_class"):
            problems += [f"{what}: {p}" for p in _layer_path_problems(release, mod, entry)]
    return problems


def _keyword_problems(sig: dict, keywords: list[str], positional: int = 0, bound: int = 0) -> list[str]:
    names = sig["params"][bound:]
    out = [f"no parameter {k!r}" for k in keywords if k not in names + sig["kwonly"] and not sig["varkw"]]
    if positional > len(names) and not sig["varargs"]:
        out.append(f"takes {len(names)} positional arguments, the plugin passes {positional}")
    return out


def _call_problems(release: Release, mod: str, entry: dict, call: dict) -> list[str]:
    if entry["kind"] == "function":
        return _keyword_problems(entry, call["keywords"], call["positional"])
    if entry["kind"] == "class":
        init = next((c["methods"]["__init__"] for c in release.class_chain(mod, entry) if "__init__" in c["methods"]),
                    None)
        return [] if init is None else _keyword_problems(init, call["keywords"], call["positional"], bound=1)
    return []


def _class_of_value(release: Release, mod: str, entry: dict) -> tuple[str, dict] | None:
    if entry["kind"] == "class":
        return mod, entry
    if entry["kind"] == "value" and entry.get("call"):
        found = release.resolve(mod, entry["call"].split(".")[-1])
        return found if found and found[1]["kind"] == "class" else None
    return None


def _layer_path_problems(release: Release, mod: str, entry: dict) -> list[str]:
    """Each step of LAYER_PATH is an attribute some vLLM class on the model's module path assigns, and a class that
    assigns the last one has a forward taking CAPTURED."""
    classes = [c for m in _family_modules(release, mod) for c in (release.module(m) or {}).values()
               if c["kind"] == "class"]
    out = [f"no class of its model assigns self.{step}" for step in LAYER_PATH
           if not any(step in c["attrs"] for c in classes)]
    attn = [c for c in classes if LAYER_PATH[-1] in c["attrs"]]
    if attn and not any(CAPTURED in c["methods"].get("forward", {}).get("params", []) for c in attn):
        out.append(f"no attention module's forward takes {CAPTURED!r}")
    return out


def _family_modules(release: Release, mod: str) -> list[str]:
    """The model's module and the model modules it imports classes from (Mistral builds on Llama's)."""
    mods = [mod]
    for e in (release.module(mod) or {}).values():
        if e["kind"] == "import" and e["from"].startswith("vllm.model_executor.models.") and e["from"] not in mods:
            mods.append(e["from"])
    return mods


def take_snapshot(release: Release, needs: list[dict]) -> dict:
    check(release, needs)  # reads exactly the modules a check reads
    return {"version": release.version, "taken_from": "the wheel's sources (scripts/vllm_api.py snapshot)",
            "modules": dict(sorted(release.touched.items()))}  # null: looked for, absent


def installed_root() -> Path:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: no vllm is installed in this Python")
    return Path(list(spec.submodule_search_locations)[0]).parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="record what a release has, from its wheel or the installed vllm")
    s.add_argument("--wheel", type=Path)
    s.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="check the plugin against a snapshot file or the installed vllm")
    c.add_argument("snapshot", type=Path, nargs="?")
    c.add_argument("--installed", action="store_true")
    a = p.parse_args(argv)
    needs = requirements()
    if a.cmd == "snapshot":
        release = Release(wheel=a.wheel) if a.wheel else Release(root=installed_root())
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(take_snapshot(release, needs), indent=1, sort_keys=True) + "\n")
        print(f"vLLM {release.version}: {len(release.touched)} modules -> {a.out}")
        return 0
    release = Release(root=installed_root()) if a.installed else Release(snapshot=json.loads(a.snapshot.read_text()))
    problems = check(release, needs)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    print(f"vLLM {release.version}: {len(needs)} needs of the plugin, {len(problems)} unmet")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
