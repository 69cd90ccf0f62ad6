"""The one subprocess wrapper the demo, the benchmarks, replay and the tests use."""

from __future__ import annotations

import os
import sys
import time

from phasewise.kit.procs import ManagedProcess


def test_managed_process_stop_ends_its_whole_process_group(tmp_path):
    # a leader that ignores SIGTERM and a child that would outlive it
    script = ("import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\ntime.sleep(600)\n")
    p = ManagedProcess("stubborn", [sys.executable, "-c", script], env=dict(os.environ),
                       log_path=tmp_path / "p.log").start()
    deadline = time.monotonic() + 60
    while len(p.leftovers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(p.leftovers()) == 2
    p.stop(timeout_s=0.5)
    assert not p.alive() and p.leftovers() == []


def test_a_role_process_runs_the_cli_and_starts_its_log_afresh_unless_told_to_append(tmp_path):
    from pathlib import Path

    from phasewise.kit.procs import RoleProcess

    schemas = Path(__file__).resolve().parents[2] / "infra" / "schemas"
    log = tmp_path / "role.log"
    for append, lines in ((False, 1), (False, 1), (True, 2)):
        p = RoleProcess("schemas", ["--check", str(schemas)], env={}, log_path=log, append=append).start()
        p.proc.wait(60)
        assert p.stop() == 0 and not p.alive()
        assert log.read_text().count("schemas current in") == lines, log.read_text()
