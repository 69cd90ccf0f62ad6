"""The project's import graph keeps its one-way arrows.

Every module of the packages ``pyproject.toml`` installs is read with :mod:`ast` (not
imported); every ``import`` and ``from ... import`` counts, also those inside functions
and under ``if TYPE_CHECKING:``. An import of a project module is an edge to that module
(``from phasewise.replay import cli`` to ``phasewise.replay.cli``, ``from phasewise.schemas
import Decision`` to ``phasewise.schemas``); any other is a third-party (or standard
library) import, known by its top-level name. The checks:

- no import cycle between the project's modules;
- the kit (``phasewise/*.py`` and ``phasewise.infra``) imports no app (``phasewise.replay``,
  ``phasewise.demo``, ``phasewise.bench``) and no role (``phasewise.streams``,
  ``phasewise.producers``, ``phasewise.actuators``); the CLI names the apps and the roles in
  ``phasewise.cli.ROLES`` and imports one only when its command runs;
- no role imports an app;
- ``phasewise.models`` (the pure decision logic) imports no Kafka, Faust, Prometheus,
  psutil, NVML, subprocess, socket or sqlite, no project IO module (``phasewise.kafka``,
  ``cgroupfs``, ``cli``, ``settings``, ``procs``), no role and no app.

Each failure lists every offending import with its file and line.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

APPS = ("phasewise.replay", "phasewise.demo", "phasewise.bench", "phasewise.horus", "phasewise.experiment")
ROLES = ("phasewise.streams", "phasewise.producers", "phasewise.actuators")
#: third-party and standard-library modules ``phasewise.models`` must not import (top-level names)
MODELS_NO_LIBRARIES = ("confluent_kafka", "aiokafka", "faust", "mode", "prometheus_client", "psutil", "pynvml",
                       "subprocess", "socket", "sqlite3")
#: project modules with IO or process-wide state that ``phasewise.models`` must not import
MODELS_NO_PROJECT = ("phasewise.kafka", "phasewise.cgroupfs", "phasewise.cli", "phasewise.settings",
                     "phasewise.procs", *ROLES, *APPS)


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


def package_dirs(pyproject: Path = REPO / "pyproject.toml") -> dict[str, Path]:
    """Installed package name -> its folder, from setuptools' ``package-dir``."""
    cfg = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    return {name: pyproject.parent / d for name, d in cfg["package-dir"].items()}


def project_modules(dirs: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the package folders (a package is its ``__init__``)."""
    out: dict[str, Path] = {}
    for pkg, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


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


def import_graph(dirs: dict[str, Path] | None = None) -> tuple[dict[str, Path], list[Import]]:
    modules = project_modules(dirs or package_dirs())
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


def _in(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def is_kit(module: str) -> bool:
    """``phasewise`` itself, its top-level modules (``phasewise/*.py``) and ``phasewise.infra``."""
    if module == "phasewise" or _in(module, ("phasewise.infra",)):
        return True
    packages = (*APPS, *ROLES, "phasewise.models", "phasewise.data")
    return module.count(".") == 1 and not _in(module, packages)


def kit_violations(edges: Iterable[Import]) -> list[Import]:
    return [e for e in edges if e.project and is_kit(e.module) and _in(e.target, (*APPS, *ROLES))]


def models_violations(edges: Iterable[Import]) -> list[Import]:
    return [e for e in edges if _in(e.module, ("phasewise.models",))
            and (_in(e.target, MODELS_NO_PROJECT) if e.project else e.target in MODELS_NO_LIBRARIES)]


def _report(what: str, bad: list[Import]) -> str:
    return f"{len(bad)} {what}:\n" + "\n".join(f"  {b}" for b in bad)


GRAPH = import_graph()


# ---------------------------------------------------------------- the checks


def test_no_import_cycle():
    modules, edges = GRAPH
    found = cycles(modules, edges)
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        lines += [f"  {e}" for e in edges if e.project and e.module in comp and e.target in comp]
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_the_kit_imports_no_app_and_no_role():
    bad = kit_violations(GRAPH[1])
    assert not bad, _report("imports of an app or a role by the kit", bad)


def test_the_roles_import_no_app():
    bad = [e for e in GRAPH[1] if e.project and _in(e.module, ROLES) and _in(e.target, APPS)]
    assert not bad, _report("imports of an app by a role", bad)


def test_models_import_no_io():
    bad = models_violations(GRAPH[1])
    assert not bad, _report("IO imports in phasewise.models", bad)


# ---------------------------------------------------------------- the checks can fail


def test_the_graph_holds_every_package_and_the_imports_inside_functions():
    modules, edges = GRAPH
    assert {"phasewise", "phasewise.replay.cli", "phasewise.demo.run", "phasewise.models.vpa",
            "phasewise.streams.worker", "phasewise.infra.broker", "phasewise.bench.harness"} <= set(modules)
    pairs = {(e.module, e.target) for e in edges}
    assert ("phasewise.replay.cli", "phasewise.replay.driving") in pairs  # at the top
    assert ("phasewise.replay.cli", "phasewise.replay.report") in pairs  # inside run()
    assert ("phasewise.cli", "phasewise.settings") in pairs  # inside add_setting()
    assert ("phasewise.streams.topics", "phasewise.topics") in pairs  # `from phasewise import topics`
    assert ("phasewise.replay.kafka", "confluent_kafka") in pairs
    assert is_kit("phasewise.schemas") and is_kit("phasewise.infra.broker") and is_kit("phasewise")
    assert not any(is_kit(m) for m in ("phasewise.replay", "phasewise.replay.cli", "phasewise.demo.jobs",
                                       "phasewise.models.vpa", "phasewise.streams.worker",
                                       "phasewise.data.make_pretrained"))


def test_a_cycle_a_kit_import_of_an_app_and_io_in_models_are_found(tmp_path):
    def write(rel: str, text: str = "") -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    write("pw/__init__.py")
    write("pw/kit.py", "def f():\n    from phasewise.replay import a\n")
    write("pw/replay/__init__.py")
    write("pw/replay/a.py", "from . import b\n")
    write("pw/replay/b.py", "import json\nfrom phasewise.replay.a import x, y\n")
    write("pw/settings.py")
    write("models/__init__.py")
    write("models/pure.py", "import math\nimport numpy as np\n\n"
                            "def f():\n    import subprocess\n    from phasewise.settings import Settings\n")
    modules, edges = import_graph({"phasewise": tmp_path / "pw", "phasewise.models": tmp_path / "models"})
    assert cycles(modules, edges) == [["phasewise.replay.a", "phasewise.replay.b"]]
    assert [(e.module, e.target, e.line) for e in kit_violations(edges)] == [("phasewise.kit", "phasewise.replay.a", 2)]
    assert [(e.module, e.target, e.line) for e in models_violations(edges)] == [
        ("phasewise.models.pure", "subprocess", 5), ("phasewise.models.pure", "phasewise.settings", 6)]
    assert [(e.target, e.line) for e in edges if e.module == "phasewise.replay.b"] == [
        ("json", 1), ("phasewise.replay.a", 2)]


def test_every_package_on_disk_is_in_the_distribution():
    """A wheel holds only the packages pyproject names: a new package left out works editable and breaks installs."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: REPO / path for name, path in tool["package-dir"].items()}
    on_disk = set()
    for top, root in dirs.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            if any(part.startswith((".", "__")) or part in ("tests", "build") for part in rel.parts):
                continue
            on_disk.add(".".join((*top.split("."), *rel.parts)))
    missing = sorted(on_disk - set(tool["packages"]))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
