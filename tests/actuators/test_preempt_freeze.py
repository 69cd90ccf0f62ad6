"""A priority decision freezes a real process through the real actuator (cgroup v1 freezer, needs root).

The policy's freeze decision goes through ``Actuator.handle`` (decode, ledger,
safety rules, the cgroup backend): ``freezer.state`` reads FROZEN when the
handler returns, the frozen process makes no progress, and after the thaw it
goes on from the step it had reached (no completed step lost). The time from
decision to frozen is measured by ``phasewise experiment priorities``.
"""

from __future__ import annotations

import time

from phasewise.kit.records import encode
from phasewise.models.jobs.priorities import Capacity, JobRequest, PriorityConfig, PriorityPolicy, to_decision
from tests.actuators.backends.test_cgroup_v1 import actuator, managed  # noqa: F401 - the fixture
from tests.actuators.conftest import own
from tests.conftest import requires_root

pytestmark = requires_root

# counts "steps" as fast as it can and prints the count every 10 ms
COUNTER = """
import sys, time
sys.stdin.readline()
print("ready", flush=True)
n, t = 0, time.monotonic()
while True:
    n += 1
    if time.monotonic() - t > 0.01:
        print(n, flush=True)
        t = time.monotonic()
"""


def _last_count(p, wait_s: float = 0.0) -> int | None:
    """With *wait_s*: the first count printed within it (None: none). Without: the last count printed so far.

    Reads whole lines only (a read may end inside a line); the child's end is an error, not "no count".
    """
    import os
    import select

    last, pending = None, b""
    deadline = time.monotonic() + wait_s
    while True:
        quiet = max(0.0, deadline - time.monotonic()) if wait_s else 0.2
        if not select.select([p.stdout], [], [], quiet)[0]:
            return last
        chunk = os.read(p.stdout.fileno(), 1 << 16)
        if not chunk:
            raise AssertionError(f"the counter ended (exit status {p.poll()})")
        *lines, pending = (pending + chunk).split(b"\n")
        counts = [int(x) for x in lines if x.strip().isdigit()]
        if counts:
            last = counts[-1]
            if wait_s:
                return last


def test_a_decision_freezes_at_once_and_no_step_is_lost(managed, recorder):  # noqa: F811
    import subprocess
    import sys

    managed.layout.create("low")
    p = subprocess.Popen([sys.executable, "-c", COUNTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         bufsize=0)
    managed.procs.append(p)
    managed.layout.attach("low", p.pid)
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.3)

    pol = PriorityPolicy(PriorityConfig(freeze_max_wait_s=60, grace_s=30, cpu_weight_ratio=None),
                         {"h1": Capacity(2, 8e9)})
    pol.submit(JobRequest("low", "h1", cpu_cores=2), now=0)
    act = actuator(managed, recorder)
    own(act, "low")  # as if this actuator had started it
    state = managed.file("low", "freezer", "freezer.state")

    t_decide = time.time()
    actions = pol.submit(JobRequest("hi", "h1", cpu_cores=1, priority=5, expected_s=10), now=t_decide)
    assert [(a.kind, a.job) for a in actions] == [("freeze", "low"), ("start", "hi")]
    d = to_decision(actions[0], ts=t_decide)
    out = act.handle(encode(d), b"h1", 0, 0)
    assert state.read_text().strip() == "FROZEN"
    latency = time.time() - t_decide
    assert out.status == "applied", out.message
    # how long it takes is measured by `phasewise experiment priorities` (preempt_to_frozen_ms), not here
    print(f"decision -> frozen in {latency * 1e3:.1f} ms")

    frozen_at = _last_count(p)  # drain what was printed before the freeze
    time.sleep(0.5)
    assert _last_count(p) is None, "a frozen process made progress"

    thaw = pol.finish("hi", now=time.time())
    assert [(a.kind, a.job) for a in thaw] == [("thaw", "low")]
    out = act.handle(encode(to_decision(thaw[0], ts=time.time())), b"h1", 0, 1)
    assert out.status == "applied", out.message
    after = _last_count(p, wait_s=30)  # the first count it prints once it runs again
    assert after is not None, f"nothing printed 30 s after the thaw; freezer.state {state.read_text().strip()}"
    assert after > frozen_at  # it goes on from where it was, not from 0
