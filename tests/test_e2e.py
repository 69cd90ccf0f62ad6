"""The closed loop on real parts: a CPU burner in a real cgroup, the real roles.

producer (cgroup sampler) -> samples topic -> Faust worker (VPA) -> decision ->
actuator (cgroup backend) -> cpu.cfs_quota_us changes -> throttling changes.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.kafka.client import make_consumer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import Actuation, Decision, SchemaError, decode
from phasewise.kit.topics import ACTUATIONS, DECISIONS
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.broker, pytest.mark.slow]

PERIOD = 100_000
#: the starting quota: 0.02 cores, far below what the burner gets even on a busy host (a 0.25-core quota
#: was no limit at all at load 9 on 2 cores: the burner got less than that anyway and was never throttled)
START_QUOTA = PERIOD // 50
BURN = "import time\nwhile True:\n    pass\n"


def throttle_rate(cpu_dir: Path, seconds: float) -> float:
    """Share of the next *seconds* the cgroup spent throttled (``cpu.stat`` ``throttled_time``).

    Not the share of throttled periods: a 1-core burner is throttled in every period under any quota
    below 1 core, so that share stays at 1 when a limit is raised from 0.25 to 0.6 cores; the time it
    waits in each period follows the quota."""

    def read() -> dict[str, int]:
        return {k: int(v) for k, v in (ln.split() for ln in (cpu_dir / "cpu.stat").read_text().splitlines())}

    a = read()
    t0 = time.monotonic()
    time.sleep(seconds)
    b = read()
    return (b["throttled_time"] - a["throttled_time"]) / 1e9 / (time.monotonic() - t0)


@pytest.fixture
def burner_cgroup():
    layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwe2e-{uuid.uuid4().hex[:8]}")
    layout.create("burner")
    cpu_dir = layout.path("burner", "cpu")
    (cpu_dir / "cpu.cfs_period_us").write_text(str(PERIOD))
    (cpu_dir / "cpu.cfs_quota_us").write_text(str(START_QUOTA))  # heavily throttled
    proc = subprocess.Popen([sys.executable, "-c", BURN])
    layout.attach("burner", proc.pid)
    try:
        yield layout, cpu_dir
    finally:
        proc.kill()
        proc.wait()
        layout.remove("burner")
        for c in layout.controllers():
            try:
                layout.base(c).rmdir()
            except OSError:
                pass


def test_the_loop_changes_a_real_cgroup_limit_and_its_throttling(settings, burner_cgroup, tmp_path):
    layout, cpu_dir = burner_cgroup
    before_rate = throttle_rate(cpu_dir, 2.0)
    assert before_rate > 0.25, ("a burner under a 0.02-core quota must be throttled", before_rate)

    env = {
        "PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap,
        "PHASEWISE_HOST": settings.host,
        "PHASEWISE_CGROUP_ROOT": "/sys/fs/cgroup",
        "PHASEWISE_CGROUP_PREFIX": layout.prefix,
        "PHASEWISE_INTERVAL_S": "0.5",
        "PHASEWISE_RECOMMEND_INTERVAL_S": "2",
        "PHASEWISE_VPA_TIME_SCALE": "0.001",
        "PHASEWISE_LOG_LEVEL": "info",
    }
    roles = [
        RoleProcess("worker", ["--web-port", "0"], env={**env, "PHASEWISE_DATA_DIR": str(tmp_path / "w")},
                    log_path=tmp_path / "worker.log"),
        RoleProcess("actuate", ["--backend", "cgroup"], env={**env, "PHASEWISE_DATA_DIR": str(tmp_path / "a")},
                    log_path=tmp_path / "actuator.log"),
        RoleProcess("produce", [], env=env, log_path=tmp_path / "producer.log"),
    ]
    consumer = make_consumer(settings, f"e2e-{uuid.uuid4().hex[:6]}")
    consumer.subscribe([DECISIONS.name, ACTUATIONS.name])
    decisions: list[Decision] = []
    actuations: list[Actuation] = []
    try:
        for r in roles:
            r.start()
        deadline = time.monotonic() + 240  # a guard against a hang, not a bound on a busy host
        def done() -> bool:  # an applied actuation and the decision behind it, both read back
            ids = {d.id for d in decisions}
            return any(a.status in ("applied", "clamped") and a.decision_id in ids for a in actuations)

        while time.monotonic() < deadline and not done():
            for r in roles:
                assert r.alive(), f"{r.cmd[3]} exited:\n{r.log_tail()}"
            m = consumer.poll(0.5)
            if m is None or m.error():
                continue
            try:  # other tests share these topics, malformed records included
                rec = decode(Decision if m.topic() == DECISIONS.name else Actuation, m.value())
            except SchemaError:
                continue
            if rec.host == settings.host:
                (decisions if isinstance(rec, Decision) else actuations).append(rec)
        applied = [a for a in actuations if a.status in ("applied", "clamped")]
        assert applied, (
            "no applied actuation within 240 s\n--- worker\n" + roles[0].log_tail()
            + "\n--- actuator\n" + roles[1].log_tail() + "\n--- producer\n" + roles[2].log_tail()
        )
        # the decision behind it is on the decisions topic, for this container, from the VPA policy
        act = next(a for a in applied if a.decision_id in {d.id for d in decisions})
        dec = next(d for d in decisions if d.id == act.decision_id)
        assert dec.container == "burner" and dec.policy == "vpa" and dec.details
        # the cgroup file now holds the applied limit
        quota = int((cpu_dir / "cpu.cfs_quota_us").read_text())
        assert quota == round(act.cpu_limit_cores * PERIOD)
        assert quota != START_QUOTA
        # ... and the throttling counters follow the direction of the change
        roles[2].stop()  # freeze the loop so the limit under measurement stays put
        roles[0].stop()
        quota = int((cpu_dir / "cpu.cfs_quota_us").read_text())
        after_rate = throttle_rate(cpu_dir, 2.0)
        print(f"throttled {before_rate:.2f} s/s at {START_QUOTA / PERIOD:.3f} cores, {after_rate:.2f} s/s at "
              f"{quota / PERIOD:.3f} cores")
        # at a given share of the CPU, the time a period waits throttled falls as the quota grows
        if quota > START_QUOTA:
            assert after_rate < before_rate, (before_rate, after_rate, quota)
        else:
            assert after_rate >= before_rate, (before_rate, after_rate, quota)
    finally:
        consumer.close()
        for r in reversed(roles):
            r.stop()
