"""Terminate decisions stop real processes in real cgroups through the real actuator (needs root).

A job that honours SIGTERM (it checkpoints and exits 0) is gone within the
grace period; one that ignores SIGTERM, and keeps forking children that
ignore it too, is SIGKILLed after the grace with nothing left in its cgroup:
v1 through the freezer (frozen first, so no fork races the kill), v2 through
``cgroup.kill``. A container is terminated once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import CgroupBackend, DryRunBackend
from phasewise.actuators.commands import Terminate
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.records import Decision, encode
from phasewise.kit.settings import Settings
from tests.actuators.conftest import own
from tests.conftest import requires_root

pytestmark = requires_root

# on SIGTERM: writes its "checkpoint" and exits 0
POLITE = """
import signal, sys, time
def stop(*_):
    open(sys.argv[-1], "w").write("checkpoint")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""

# ignores SIGTERM and keeps forking short-lived children that ignore it too (at most a few at a time)
STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    pid = os.fork()
    if pid == 0:
        time.sleep(0.05)
        os._exit(0)
    os.waitpid(pid, 0)
"""

V2_ROOT = Path("/sys/fs/cgroup/unified")


class Tree:
    """A unique managed prefix in one hierarchy (v1: every controller; v2: the unified tree, no controllers
    needed: ``cgroup.procs``, ``cgroup.freeze`` and ``cgroup.kill`` are core files)."""

    def __init__(self, version: int) -> None:
        prefix = f"pwterm-{uuid.uuid4().hex[:8]}"
        if version == 1:
            self.layout = CgroupLayout("/sys/fs/cgroup", prefix=prefix, version=1)
        else:
            if not (V2_ROOT / "cgroup.procs").exists():
                pytest.skip("no cgroup2 tree at /sys/fs/cgroup/unified")
            self.layout = CgroupLayout(V2_ROOT, prefix=prefix, version=2)
        self.version = version
        self.procs: list[subprocess.Popen] = []

    def create(self, name: str) -> None:
        if self.version == 1:
            self.layout.create(name)
        else:
            (V2_ROOT / self.layout.prefix / name).mkdir(parents=True)

    def start(self, name: str, code: str, *args: str) -> subprocess.Popen:
        self.create(name)
        # the child waits for a line on stdin, so it is in the cgroup before it runs anything
        p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); exec(sys.argv[1])", code,
                              *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        self.layout.attach(name, p.pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ready"
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        dirs = ([self.layout.base(c) for c in self.layout.controllers()] if self.version == 1
                else [V2_ROOT / self.layout.prefix])
        for base in dirs:
            for d in sorted(base.glob("*"), reverse=True):
                if d.is_dir():
                    if self.version == 1 and (d / "freezer.state").exists():
                        (d / "freezer.state").write_text("THAWED")
                    d.rmdir()
            base.rmdir()


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def tree(request):
    t = Tree(request.param)
    try:
        yield t
    finally:
        t.close()


def actuator(layout: CgroupLayout, recorder, **kw) -> Actuator:
    """An actuator that owns the containers the test made so far (as if it had started their jobs)."""
    s = Settings().replace(host="h1", apply_retries=0, terminate_grace_s=10.0, terminate_grace_max_s=30.0, **kw)
    act = Actuator(s, CgroupBackend(layout, kill_wait_s=5.0), Ledger(":memory:"), recorder,
                   metrics=ActuatorMetrics(CollectorRegistry()), host_cores=2.0)
    own(act, *layout.containers())
    return act


def terminate(container: str, **details) -> bytes:
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host="h1", container=container, action="terminate",
                           policy="targets", reason="test: objective reached", details=details))


def test_sigterm_then_sigkill_after_the_grace_race_free(tree, recorder, tmp_path):
    ckpt = tmp_path / "polite.ckpt"
    polite = tree.start("polite", POLITE, str(ckpt))
    stubborn = tree.start("stubborn", STUBBORN)
    time.sleep(0.2)
    act = actuator(tree.layout, recorder)

    out = act.handle(terminate("polite", grace_s=5.0), b"h1", 0, 0)
    assert out.status == "applied", out.message
    assert "SIGTERM to 1 process(es); all exited within" in out.message  # not killed after the grace
    assert polite.wait(5) == 0 and ckpt.read_text() == "checkpoint"

    t0 = time.monotonic()
    out = act.handle(terminate("stubborn", grace_s=1.0), b"h1", 0, 1)
    took = time.monotonic() - t0
    assert out.status == "applied", out.message
    how = "frozen first, so none could fork" if tree.version == 1 else "cgroup.kill"
    assert "exited within the 1 s grace" in out.message and f"({how})" in out.message, out.message
    assert "the container is empty" in out.message
    assert took >= 1.0, took  # the grace was given
    assert stubborn.wait(5) == -signal.SIGKILL
    assert tree.layout.pids("stubborn") == [] and tree.layout.pids("polite") == []


def test_a_hard_stop_and_a_checkpoint_in_progress_get_no_sigterm(tree, recorder, tmp_path):
    ckpt = tmp_path / "polite.ckpt"
    p1 = tree.start("hard", POLITE, str(ckpt))
    p2 = tree.start("checkpointing", POLITE, str(ckpt))
    act = actuator(tree.layout, recorder)
    out = act.handle(terminate("hard", grace_s=0), b"h1", 0, 0)
    assert out.status == "applied" and "SIGTERM" not in out.message, out.message
    assert p1.wait(5) == -signal.SIGKILL and not ckpt.exists()
    t0 = time.monotonic()
    out = act.handle(terminate("checkpointing", mode="checkpoint", grace_s=0.5), b"h1", 0, 1)
    assert out.status == "applied" and "left to finish their checkpoint" in out.message, out.message
    assert p2.wait(5) == -signal.SIGKILL and not ckpt.exists()  # no SIGTERM: it never ran its handler
    assert time.monotonic() - t0 >= 0.4


def test_a_container_is_terminated_once_and_a_decision_applied_once(recorder, tmp_path):
    t = Tree(1)
    try:
        t.start("job", POLITE, str(tmp_path / "c"))
        act = actuator(t.layout, recorder)
        first = terminate("job", grace_s=2.0)
        assert act.handle(first, b"h1", 0, 0).status == "applied"
        again = act.handle(terminate("job", grace_s=2.0), b"h1", 0, 1)  # another policy, another id
        assert again.status == "rejected" and "already terminated (by decision" in again.message, again.message
        assert act.handle(first, b"h1", 0, 0).status == "duplicate"
        empty = act.handle(terminate("ghost"), b"h1", 0, 2)
        assert empty.status == "rejected" and "does not exist" in empty.message
        t.create("idle")
        own(act, "idle")
        idle = act.handle(terminate("idle"), b"h1", 0, 3)
        assert idle.status == "applied" and "nothing to stop" in idle.message
    finally:
        t.close()


def test_terminate_only_for_opted_in_containers(recorder, tmp_path):
    t = Tree(1)
    try:
        p = t.start("job", POLITE, str(tmp_path / "c"))
        act = actuator(t.layout, recorder, workload_default_mode="recommend")
        out = act.handle(terminate("job"), b"h1", 0, 0)
        assert out.status == "rejected" and "recommend mode" in out.message, out.message
        assert p.poll() is None  # untouched
    finally:
        t.close()


def test_the_dry_run_says_what_it_would_do():
    b = DryRunBackend()
    assert b.apply(Terminate("job", 5.0)).message == \
        "dry run: would stop every process of 'job': SIGTERM, then SIGKILL after 5 s"
    assert b.apply(Terminate("job", 0.0)).message == "dry run: would stop every process of 'job': SIGKILL at once"
    assert "the job is checkpointing" in b.apply(Terminate("job", 3.0, sigterm=False)).message
    assert os.getuid() == 0
