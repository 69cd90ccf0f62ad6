"""``make test`` runs this before the parallel run: pytest's assertion rewriting of the test modules, done once.

Every xdist process rewrites every test module it collects (it parses, rewrites and compiles each one: ~6 CPU-s
of the ~10 s a process spends collecting this suite) unless pytest finds the rewritten module cached in
``__pycache__``, which it does not write where ``PYTHONDONTWRITEBYTECODE`` is set, nor in a fresh clone. Two
``pytest --collect-only`` processes over halves of the test directories write that cache (with bytecode writing
allowed for them alone); the six processes of the run then read it. A failure here is not the suite's verdict:
the run itself collects and reports the same modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PROCESSES = 2


def halves(root: Path = TESTS, n: int = PROCESSES) -> list[list[str]]:
    """The test directories (and the top-level modules as one more part) in *n* groups of about equal bytes."""
    parts: list[tuple[int, list[Path]]] = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"):
        files = list(d.rglob("test_*.py"))
        if files:
            parts.append((sum(f.stat().st_size for f in files), [d]))
    top = sorted(root.glob("test_*.py"))
    if top:
        parts.append((sum(f.stat().st_size for f in top), top))
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(n)]
    for size, paths in sorted(parts, key=lambda p: -p[0]):  # largest first, each to the lightest group
        i = min(range(n), key=lambda k: groups[k][0])
        groups[i] = (groups[i][0] + size, groups[i][1] + [str(p) for p in paths])
    return [g for _, g in groups if g]


def main() -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    procs = [subprocess.Popen([*cmd, *group], cwd=TESTS.parent, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for group in halves()]
    for p in procs:
        p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
