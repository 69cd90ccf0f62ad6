"""``make test PYTEST_ARGS="-p tests.cpu_report"``: the CPU seconds each test module spent, printed at the end.

On a 2-core machine the suite is bound mostly by CPU (with six parallel processes the cores are busy ~93 % of
the run), so its wall time is about the CPU its tests burn over the cores, and the figure to cut is a module's
CPU seconds, not its duration (``--durations`` shows tests that mostly wait on a broker). Each test counts the CPU
of its process and of the child processes it waited for (``getrusage``: roles, jobs, a private dockerd at its
module's end); containers' processes are not counted. With xdist each worker sends its figures to the controller.
"""

from __future__ import annotations

import json
import resource
from collections import Counter

import pytest

TOP = 25


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuReport:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.by_module: Counter[str] = Counter()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = _cpu_s()
        yield
        self.by_module[item.nodeid.split("::", 1)[0]] += _cpu_s() - before

    def pytest_sessionfinish(self, session):
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: hand the figures to the controller
            workeroutput["cpu_report"] = json.dumps(self.by_module)

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without xdist
    def pytest_testnodedown(self, node, error):
        self.by_module.update(json.loads(getattr(node, "workeroutput", {}).get("cpu_report", "{}")))

    def pytest_terminal_summary(self, terminalreporter):
        if getattr(self.config, "workeroutput", None) is not None or not self.by_module:
            return
        total = sum(self.by_module.values())
        terminalreporter.section(f"CPU seconds by module (top {TOP}; {total:.0f} s in all)")
        for module, s in self.by_module.most_common(TOP):
            terminalreporter.write_line(f"{s:8.1f}  {module}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuReport(config), "cpu_report_plugin")
