"""The folders are the layers: every import points down the tree of ``src/phasewise/``.

Every module under ``src/phasewise/`` is read with :mod:`ast` (not imported);
every ``import`` and ``from ... import`` counts, also those inside functions.
A module's layer is its first folder below ``phasewise`` (docs/architecture.md):

- ``kit/records`` (the records of every topic) imports no other layer;
- ``models`` (the decision logic, pure) imports only ``models`` and ``kit/records``, and no
  IO library (Kafka, Faust, Prometheus, psutil, NVML, subprocess, socket, sqlite);
- ``kit`` imports only ``kit`` and ``models``;
- the roles (``streams``, ``producers``, ``actuators``) import ``kit`` and ``models``, never
  another role, an app or the CLI;
- ``apps`` import anything but the CLI;
- ``cli`` imports only ``kit`` (it names the roles and apps in ``phasewise.cli.ROLES`` and
  imports one only when its subcommand runs);
- no import cycle anywhere.

Each failure lists every offending import with its file and line.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

ROLES = ("streams", "producers", "actuators")
#: layer -> the layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "records": set(),
    "models": {"records"},
    "kit": {"records", "models"},
    **{role: {"records", "kit", "models"} for role in ROLES},
    "apps": {"records", "kit", "models", *ROLES},
    "cli": {"records", "kit"},
    "data": {"records", "kit", "models", "apps"},  # (the script that rebuilds the shipped model)
    "phasewise": set(),
}
#: third-party and standard-library modules ``models`` must not import (top-level names)
MODELS_NO_LIBRARIES = ("confluent_kafka", "aiokafka", "faust", "mode", "prometheus_client", "psutil", "pynvml",
                       "subprocess", "socket", "sqlite3")


@dataclass(frozen=True)
class Import:
    """One import statement's target, as written and as resolved."""

    module: str  #: the importing module
    target: str  #: a project module, or a third-party top-level name
    project: bool
    path: Path
    line: int

    def __str__(self) -> str:
        where = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{where}:{self.line}: {self.module} -> {self.target}"


def project_modules(src: Path = SRC) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under *src* (a package is its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted(src.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer(module: str) -> str:
    """The folder a module lies in: ``kit/records`` is ``records``, else the first folder below ``phasewise``."""
    parts = module.split(".")
    if parts[1:3] == ["kit", "records"]:
        return "records"
    return parts[1] if len(parts) > 1 else "phasewise"


def _resolve(name: str, modules: Iterable[str]) -> str | None:
    """The longest project module that *name* is or lies in."""
    mods = set(modules)
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        if cand in mods:
            return cand
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import in *path* (module *module*), wherever it stands in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []

    def add(name: str, line: int) -> None:
        target = _resolve(name, modules)
        if target is not None:
            out.append(Import(module, target, True, path, line))
        elif not name.startswith("phasewise.") and name != "phasewise":
            out.append(Import(module, name.split(".")[0], False, path, line))
        else:
            raise AssertionError(f"{path}:{line}: {name} is no module of the project")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for a in node.names:
                sub = f"{name}.{a.name}"
                # `from pkg import submodule` imports the submodule; `from mod import name`, the module
                add(sub if sub in modules else name, node.lineno)
    return list(dict.fromkeys(out))  # one per (target, line): `from m import a, b` is one import of m


def import_graph(src: Path = SRC) -> tuple[dict[str, Path], list[Import]]:
    modules = project_modules(src)
    edges = [imp for m, p in modules.items() for imp in imports_of(m, p, modules)]
    return modules, edges


def cycles(modules: Iterable[str], edges: Iterable[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    succ: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.project:
            succ[e.module].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(succ):  # Tarjan's algorithm, iterative
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in succ[v]:
                    found.append(sorted(comp))
    return found


def layer_violations(edges: Iterable[Import]) -> list[Import]:
    """Imports of a layer its importer may not import (:data:`ALLOWED`)."""
    out = []
    for e in edges:
        if not e.project or e.target == "phasewise":  # (the package itself: its version)
            continue
        a, b = layer(e.module), layer(e.target)
        if a != b and b not in ALLOWED[a]:
            out.append(e)
    return out


def models_io(edges: Iterable[Import]) -> list[Import]:
    return [e for e in edges if layer(e.module) == "models" and not e.project and e.target in MODELS_NO_LIBRARIES]


def _report(what: str, bad: list[Import]) -> str:
    return f"{len(bad)} {what}:\n" + "\n".join(f"  {b}" for b in bad)


@functools.cache
def graph() -> tuple[dict[str, Path], list[Import]]:
    """The project's import graph, read once where a check runs (not at collection, in every test process)."""
    return import_graph()


# ---------------------------------------------------------------- the checks


def test_no_import_cycle():
    modules, edges = graph()
    found = cycles(modules, edges)
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        lines += [f"  {e}" for e in edges if e.project and e.module in comp and e.target in comp]
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_every_import_points_down_the_tree():
    bad = layer_violations(graph()[1])
    assert not bad, _report("imports against the layers (docs/architecture.md)", bad)


def test_models_import_no_io():
    bad = models_io(graph()[1])
    assert not bad, _report("IO imports in phasewise.models", bad)


def test_every_folder_is_a_layer_and_every_package_installs():
    """A folder under src/phasewise/ is a layer (or a wing inside one), and setuptools finds each package."""
    top = {p.name for p in (SRC / "phasewise").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert top == {"cli", "kit", "models", "streams", "producers", "actuators", "apps", "data"}, top
    for d in (SRC / "phasewise").rglob("*"):
        if d.is_dir() and d.name != "__pycache__" and d.name != "data" and any(d.glob("*.py")):
            assert (d / "__init__.py").exists(), f"{d.relative_to(REPO)} holds modules but no __init__.py"


# ---------------------------------------------------------------- the checks can fail


def test_the_graph_holds_every_layer_and_the_imports_inside_functions():
    modules, edges = graph()
    assert {"phasewise", "phasewise.apps.replay.cli", "phasewise.apps.demo.run", "phasewise.models.vpa.recommender",
            "phasewise.streams.worker", "phasewise.kit.broker", "phasewise.apps.bench.harness",
            "phasewise.apps.simulate.engine"} <= set(modules)
    pairs = {(e.module, e.target) for e in edges}
    assert ("phasewise.apps.replay.cli", "phasewise.apps.replay.driving") in pairs  # at the top
    assert ("phasewise.apps.replay.cli", "phasewise.apps.replay.report") in pairs  # inside run()
    assert ("phasewise.kit.command", "phasewise.kit.settings") in pairs  # inside add_setting()
    assert ("phasewise.apps.replay.through_kafka", "confluent_kafka") in pairs
    assert {layer(m) for m in modules} == {*ALLOWED}
    assert layer("phasewise.kit.records.learn_batches") == "records" and layer("phasewise.kit.topics") == "kit"


def test_a_cycle_an_upward_import_and_io_in_models_are_found(tmp_path):
    def write(rel: str, text: str = "") -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    write("phasewise/__init__.py")
    write("phasewise/kit/__init__.py")
    write("phasewise/kit/topics.py", "def f():\n    from phasewise.apps.replay import a\n")
    write("phasewise/apps/__init__.py")
    write("phasewise/apps/replay/__init__.py")
    write("phasewise/apps/replay/a.py", "from . import b\n")
    write("phasewise/apps/replay/b.py", "import json\nfrom phasewise.apps.replay.a import x, y\n")
    write("phasewise/streams/__init__.py")
    write("phasewise/streams/w.py", "from phasewise.actuators import c\n")
    write("phasewise/actuators/__init__.py")
    write("phasewise/actuators/c.py")
    write("phasewise/models/__init__.py")
    write("phasewise/models/pure.py", "import math\nimport numpy as np\n\n"
                                      "def f():\n    import subprocess\n    from phasewise.kit import topics\n")
    modules, edges = import_graph(tmp_path)
    assert cycles(modules, edges) == [["phasewise.apps.replay.a", "phasewise.apps.replay.b"]]
    assert [(e.module, e.target, e.line) for e in layer_violations(edges)] == sorted([
        ("phasewise.kit.topics", "phasewise.apps.replay.a", 2), ("phasewise.models.pure", "phasewise.kit.topics", 6),
        ("phasewise.streams.w", "phasewise.actuators.c", 1)], key=lambda t: t[0])
    assert [(e.module, e.target, e.line) for e in models_io(edges)] == [("phasewise.models.pure", "subprocess", 5)]
    assert [(e.target, e.line) for e in edges if e.module == "phasewise.apps.replay.b"] == [
        ("json", 1), ("phasewise.apps.replay.a", 2)]
