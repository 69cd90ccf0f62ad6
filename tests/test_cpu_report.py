"""tests/cpu_report.py: the CPU seconds of each module, from the controller of parallel workers too."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]

BURN = """
import subprocess, sys
def test_burn():
    subprocess.run([sys.executable, "-c", "n = 0\\nfor i in range(3_000_000): n += i"], check=True)
"""
IDLE = """
def test_idle():
    pass
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_module_is_charged_the_cpu_of_the_children_its_tests_waited_for(pytester, monkeypatch, workers):
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the plugin is tests.cpu_report, from this checkout
    pytester.makepyfile(test_burn=BURN, test_idle=IDLE)
    r = pytester.runpytest_subprocess("-p", "tests.cpu_report", "-p", "no:cacheprovider", *workers)
    r.assert_outcomes(passed=2)
    lines = r.outlines[next(i for i, line in enumerate(r.outlines) if "CPU seconds by module" in line) + 1:]
    rows = {line.split()[1]: float(line.split()[0]) for line in lines if line.strip().endswith(".py")}
    assert set(rows) == {"test_burn.py", "test_idle.py"}, r.outlines
    assert rows["test_burn.py"] > rows["test_idle.py"], rows
