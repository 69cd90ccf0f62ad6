"""cgroup v2 writes, against a fixture tree with v2's files (this host has no v2 controllers)."""

from __future__ import annotations

import pytest

from phasewise.actuators.backends import CgroupBackend, DryRunBackend
from phasewise.actuators.backends.job_watch import ExitStatus
from phasewise.actuators.commands import Freeze, SetLimits, Thaw
from phasewise.kit.cgroups.fs import CgroupLayout


@pytest.fixture
def v2(tmp_path):
    root = tmp_path / "cg2"
    (root / "pw" / "job-a").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    d = root / "pw" / "job-a"
    for name, text in {"cpu.max": "max 100000\n", "memory.max": "max\n", "cgroup.freeze": "0\n",
                       "memory.current": "209715200\n",
                       "memory.stat": "anon 104857600\nfile 104857600\ninactive_file 52428800\n",
                       "cgroup.controllers": "cpu memory\n"}.items():
        (d / name).write_text(text)
    layout = CgroupLayout(root, prefix="pw")
    assert layout.version == 2
    return CgroupBackend(layout), d


def test_v2_cpu_limit_is_written_as_quota_and_period(v2):
    backend, d = v2
    out = backend.apply(SetLimits("job-a", cpu_cores=1.5))
    assert (d / "cpu.max").read_text() == "150000 100000"
    assert out.status == "applied" and out.cpu_cores == 1.5 and backend.name == "cgroup-v2"


def test_v2_tiny_cpu_limits_get_the_kernel_minimum_quota(v2):
    backend, d = v2
    backend.apply(SetLimits("job-a", cpu_cores=0.001))
    assert (d / "cpu.max").read_text() == "1000 100000"


def test_v2_memory_limit_goes_to_memory_max(v2):
    backend, d = v2
    out = backend.apply(SetLimits("job-a", mem_bytes=300 * 2**20))
    assert (d / "memory.max").read_text() == str(300 * 2**20)
    assert out.mem_bytes == 300 * 2**20 and out.cpu_cores is None


def test_v2_freeze_and_thaw_write_cgroup_freeze(v2):
    backend, d = v2
    assert backend.apply(Freeze("job-a")).status == "applied"
    assert (d / "cgroup.freeze").read_text() == "1"
    assert backend.apply(Thaw("job-a")).status == "applied"
    assert (d / "cgroup.freeze").read_text() == "0"


def test_v2_freeze_waits_for_the_kernel_to_report_frozen(v2):
    backend, d = v2
    (d / "cgroup.events").write_text("populated 1\nfrozen 0\n")  # a kernel that never completes
    backend.freeze_timeout_s = 0.05
    out = backend.apply(Freeze("job-a"))
    assert out.status == "failed" and out.temporary and "frozen=1" in out.message


def test_v2_memory_usage_is_the_working_set(v2):
    backend, _ = v2
    assert backend.memory_usage("job-a") == 209715200 - 52428800
    assert backend.memory_usage("missing") is None


def test_v2_existence_follows_the_tree(v2):
    backend, _ = v2
    assert backend.exists("job-a")
    assert not backend.exists("job-b")
    assert not backend.exists("../pw")


def test_writing_into_a_vanished_container_fails_permanently(v2):
    backend, _ = v2
    out = backend.apply(SetLimits("gone", cpu_cores=1.0))
    assert out.status == "failed" and not out.temporary and "gone" in out.message


def test_a_cpu_write_that_succeeds_is_reported_when_the_memory_write_fails(v2):
    backend, d = v2
    (d / "memory.max").unlink()
    out = backend.apply(SetLimits("job-a", cpu_cores=2.0, mem_bytes=300 * 2**20))
    assert out.status == "failed" and out.cpu_cores == 2.0 and "already set: cpu 2 cores" in out.message


def test_dry_run_records_commands_and_changes_nothing(v2):
    real, d = v2
    dry = DryRunBackend(usage=real.memory_usage)
    cmds = [SetLimits("job-a", cpu_cores=1.0, mem_bytes=2**30), Freeze("job-a"), Thaw("job-a")]
    outs = [dry.apply(c) for c in cmds]
    assert dry.commands == cmds
    assert [o.status for o in outs] == ["applied"] * 3
    assert outs[0].cpu_cores == 1.0 and outs[0].mem_bytes == 2**30
    assert (d / "cpu.max").read_text() == "max 100000\n"
    assert dry.memory_usage("job-a") == real.memory_usage("job-a")
    assert DryRunBackend().memory_usage("job-a") is None and DryRunBackend().exists("anything")


def test_the_dry_run_backend_reads_real_usage_when_the_cgroup_tree_is_there(v2, tmp_path):
    from phasewise.actuators.consumer import make_backend
    from phasewise.kit.settings import Settings

    _, d = v2
    root = str(d.parent.parent)
    dry = make_backend(Settings().replace(backend="dry-run", cgroup_root=root, cgroup_prefix="pw"))
    assert dry.name == "dry-run" and dry.memory_usage("job-a") == 209715200 - 52428800
    # a missing container is missing for the dry run too, so the actuator rejects it as the cgroup one does
    assert dry.exists("job-a") and not dry.exists("gone") and not dry.exists("job-a\n")
    nowhere = make_backend(Settings().replace(backend="dry-run",
                                              cgroup_root=str(tmp_path / "none")))
    assert nowhere.memory_usage("job-a") is None
    real = make_backend(Settings().replace(backend="cgroup", cgroup_root=root, cgroup_prefix="pw"))
    assert real.name == "cgroup-v2"


def test_the_dry_run_actuator_rejects_a_missing_container_and_a_name_with_a_trailing_newline(v2, recorder):
    from prometheus_client import CollectorRegistry

    from phasewise.actuators.actuator import Actuator
    from phasewise.actuators.consumer import make_backend
    from phasewise.actuators.ledger import Ledger
    from phasewise.actuators.metrics import ActuatorMetrics
    from phasewise.kit.records import Decision, encode
    from phasewise.kit.settings import Settings
    from tests.actuators.conftest import own

    _, d = v2
    s = Settings().replace(host="h1", backend="dry-run", cgroup_root=str(d.parent.parent), cgroup_prefix="pw")
    backend = make_backend(s)
    a = Actuator(s, backend, Ledger(":memory:"), recorder, metrics=ActuatorMetrics(CollectorRegistry()),
                 host_cores=4.0)
    own(a, "job-a", "gone")
    got = {}
    for c in ("job-a", "gone", "job-a\n"):
        raw = encode(Decision(id=f"id-{c!r}", ts=a.clock(), host="h1", container=c, action="freeze",
                              policy="test"))
        got[c] = a.handle(raw, b"h1", 0, 0)
    assert got["job-a"].status == "applied"
    assert got["gone"].status == "rejected" and "does not exist" in got["gone"].message
    assert got["job-a\n"].status == "rejected" and "not a managed container name" in got["job-a\n"].message
    assert [type(c).__name__ for c in backend.commands] == ["Freeze"]


def test_v2_oom_kills_are_read_from_memory_events_and_decide_oom_at_the_end(v2):
    backend, d = v2
    assert backend.oom_kills("job-a") is None  # no memory.events (a kernel before 4.13 has no oom_kill)
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 2\noom_group_kill 0\n")
    assert backend.oom_kills("job-a") == 2
    assert backend.cgroup_of("job-a") == "pw/job-a"
    seen = []
    backend.on_exit = seen.append
    # the count at its start was 2: an end with the count still 2 is no OOM kill, with 3 it is one
    backend._ended("job-a", 4242, ExitStatus(None, 9, "waited"), 2, 100.0)
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 3\noom_group_kill 0\n")
    backend._ended("job-a", 4243, ExitStatus(None, 9, "waited"), 2, 101.0)
    assert [(e.pid, e.signal, e.oom, e.oom_kills) for e in seen] == [(4242, 9, False, 0), (4243, 9, True, 1)]
