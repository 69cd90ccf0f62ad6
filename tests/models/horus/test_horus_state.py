"""HorusState in the live flow, pure: a job learned once (at observe_s or at its end), its outcome with
the log error, its events routed from the job side to the host side (as between two workers), and the
model shared between workers through snapshots (the union, no job twice)."""

from __future__ import annotations

import base64
import zlib

import pytest

from phasewise.kit.records import (
    ContainerSample,
    HostSamples,
    JobEvent,
    JobSpec,
    ModelSnapshot,
    PhaseChange,
    SchemaError,
    UtilisationPrediction,
    decode,
    encode,
)
from phasewise.kit.records.routes import HorusRoute
from phasewise.models.horus.graph_features import catalog_features
from phasewise.models.horus.join import JoinConfig
from phasewise.models.horus.model import HorusConfig
from phasewise.models.horus.snapshot import SNAPSHOT_NAME, observations_of, snapshot_of
from phasewise.models.horus.state import HorusState, HorusStateConfig

SPEC = JobSpec(model="mlp-32x64x4", dataset="vectors", batch_size=16)


def state(observe_s: float = 2.0) -> HorusState:
    return HorusState(HorusStateConfig(model=HorusConfig(coverage=0.8),
                                       join=JoinConfig(warmup_s=0.0, min_samples=2, observe_s=observe_s),
                                       partitions=4))


def feats():
    return catalog_features("mlp-32x64x4", "vectors", 16, False)


def end(st: HorusState, ev: JobEvent, host_side: HorusState | None = None):
    """*ev* ends its job on *st*'s job side, routed to *host_side* (default: *st*); what was learned."""
    r = st.end(ev)
    return [] if r is None else (host_side or st).route(decode(HorusRoute, encode(r)))


def run(st: HorusState, job: str, cpu: float, t0: float, n: int = 4):
    """Submit, start and sample *job* (*n* samples of *cpu* cores one second apart); what was learned."""
    st.predict(JobEvent(job=job, ts=t0, kind="submitted", spec=SPEC), feats())
    assert st.route(st.started(JobEvent(job=job, ts=t0, kind="started", host="h", container=job))) == []
    out = []
    for i in range(1, n + 1):
        out += st.samples(HostSamples(host="h", ts=t0 + i, interval_s=1.0, containers=(
            ContainerSample(container=job, cpu_cores=cpu, mem_bytes=3e8),)))
    return out


def test_a_job_is_learned_once_with_its_outcome_and_the_error_falls():
    st = state()
    errors = []
    for i in range(4):
        got = run(st, f"j{i}", 0.3, 100.0 * i)
        assert len(got) == 1  # at observe_s, not again at its end
        o, err = got[0]
        assert end(st, JobEvent(job=o.job, ts=100.0 * i + 9, kind="finished")) == []
        out = st.outcome(o, err)
        assert isinstance(out, UtilisationPrediction) and out.model_version == i
        assert out.observed["cpu_cores"] == pytest.approx(0.3) and out.log_error == err
        assert out.cpu_cores.lo <= out.cpu_cores.mean <= out.cpu_cores.hi
        assert decode(UtilisationPrediction, encode(out)) == out
        errors.append(err["cpu_cores"])
    assert errors[-1] < errors[0] / 4, errors
    assert st.model.jobs == 4 and list(st.kept) == ["j0", "j1", "j2", "j3"]


@pytest.mark.parametrize("kind", ["failed", "terminated", "finished"])
def test_a_job_that_ends_before_observe_s_is_learned_at_its_end(kind):
    st = state(observe_s=100.0)
    assert run(st, "a", 0.5, 0.0, n=3) == []
    (o, err), = end(st, JobEvent(job="a", ts=5.0, kind=kind))
    assert o.observed["cpu_cores"] == pytest.approx(0.5) and "cpu_cores" in err
    assert "a" not in st.join and "a" not in st.book and end(st, JobEvent(job="a", ts=6.0, kind=kind)) == []


@pytest.mark.parametrize("kind", ["lost", "rejected"])
def test_a_job_lost_or_rejected_after_its_start_is_forgotten_and_not_learned(kind):
    st = state(observe_s=100.0)
    assert run(st, "a", 0.5, 0.0, n=3) == []
    assert end(st, JobEvent(job="a", ts=5.0, kind=kind, reason="gone")) == []
    assert "a" not in st.join and "a" not in st.book and st.model.jobs == 0


def test_the_shared_model_is_the_union_and_no_job_is_learned_twice():
    a, b = state(), state()
    run(a, "x", 0.3, 0.0)
    run(a, "y", 0.3, 10.0)
    snap = decode(ModelSnapshot, encode(snapshot_of(a.shared(), 1, ts=1.0)))
    assert snap.name == SNAPSHOT_NAME and snap.samples_seen == 2
    assert b.merge(observations_of(snap), snap.version) == 2
    assert b.model.jobs == 2 and b.snapshot_version == 1
    assert b.model.predict_one(feats(), "cpu") == a.model.predict_one(feats(), "cpu")
    assert b.merge(observations_of(snap), snap.version) == 0  # read again: nothing new
    # b runs x too (another group saw it): it is not learned again, and a new job is
    assert run(b, "x", 0.3, 20.0) == [] and b.model.jobs == 2
    assert len(run(b, "z", 0.3, 30.0)) == 1
    assert a.merge(b.shared(), 2) == 1 and a.model.jobs == 3
    # the merged observations are table records: a restart of b restores all three
    rows = [(k, v) for k, _p, v in b.writes()]
    c = state()
    c.restore(rows)
    assert list(c.kept) == ["x", "y", "z"] and c.model.jobs == 3


def test_a_snapshot_that_is_no_horus_model_is_refused_with_the_reason():
    def snap(body: bytes, name: str = SNAPSHOT_NAME) -> ModelSnapshot:
        return ModelSnapshot(name=name, ts=1.0, version=1, payload_b64=base64.b64encode(body).decode())

    cases = [
        (snap(b"not zlib"), "payload is no Horus model"),
        (snap(zlib.compress(b"[1, 2]")), "not a Horus observation list"),
        (snap(zlib.compress(b'{"format": 1, "obs": [{"f": {}, "o": {}}]}')), "no job id"),
        (snap(zlib.compress(b'{"format": 1, "obs": [{"job": "a", "f": {}, "o": {"cpu_cores": "x"}}]}')),
         "not a finite number"),
        (snap(zlib.compress(b" " * (2**20 + 10))), "inflates to more than"),
        (snap(zlib.compress(b"{}"), name="phase-crbm/cpu+mem"), "not the Horus model"),
    ]
    for s, why in cases:
        with pytest.raises(SchemaError, match=why):
            observations_of(s, max_bytes=2**20)
    # an observation whose features do not make a feature vector is skipped, the others learned
    st = state()
    assert st.merge([{"job": "bad", "f": {"flops": 1}, "o": {"cpu_cores": 1.0}, "d": None}], 1) == 0


def test_repeated_and_out_of_order_states_change_nothing_and_are_counted():
    st = state()
    run(st, "a", 0.3, 0.0, n=1)
    failed = JobEvent(job="a", ts=5.0, kind="failed", exit_code=1)
    assert end(st, failed) == [] and "a" not in st.join  # one steady sample: not learned, forgotten
    assert st.end(failed) is None  # the same record read again: not counted
    assert st.end(JobEvent(job="a", ts=6.0, kind="finished")) is None  # a second end
    # started after its end: not routed
    assert st.started(JobEvent(job="a", ts=7.0, kind="started", host="h", container="a")) is None
    assert st.end(JobEvent(job="never", ts=1.0, kind="finished")) is None
    assert st.end(JobEvent(job="never", ts=1.0, kind="lost")) is None
    assert "a" not in st.join and len(st.join) == 0 and not st.book
    assert st.lifecycle.take_counts() == {"repeated": 1, "after_end": 1, "unknown_job": 2}
    # a job that never ran is forgotten and nothing is learned: no route, it ran nowhere
    st.predict(JobEvent(job="r", ts=1.0, kind="submitted", spec=SPEC), feats())
    assert st.end(JobEvent(job="r", ts=2.0, kind="rejected", reason="no command")) is None
    assert "r" not in st.book and "r" not in st.join and st.model.jobs == 0


def test_two_workers_one_reads_the_job_the_other_its_host_and_the_job_is_learned_once():
    """The job side on one worker, the host side on another (what two workers sharing a group split):
    the routes carry the start with its prediction, the phase change and the end; each side's table
    records go to its own key's partition and restore on the worker that holds that partition."""
    jobs, hosts = state(observe_s=100.0), state(observe_s=100.0)
    pred = jobs.predict(JobEvent(job="a", ts=1.0, kind="submitted", spec=SPEC), feats())
    r = jobs.started(JobEvent(job="a", ts=10.0, kind="started", host="h7", container="ca"))
    assert r.host == "h7" and r.prediction == pred and "a" in jobs.book and "a" not in jobs.join
    assert hosts.route(decode(HorusRoute, encode(r))) == [] and "a" in hosts.join and not hosts.book
    assert hosts.route(r) == []  # the same route again changes nothing
    # the container leaves its loading phase at 12 (warm-up 0 in these tests: samples count from the start)
    ph = PhaseChange(container="ca", host="h7", ts=12.0, new_phase=1, since=10.0)
    assert hosts.route(HorusRoute(host="h7", kind="phase", ts=12.0, phase=ph)) == []
    for t, cpu in ((13.0, 0.4), (14.0, 0.6)):
        assert hosts.samples(HostSamples(host="h7", ts=t, interval_s=1.0, containers=(
            ContainerSample(container="ca", cpu_cores=cpu, mem_bytes=4e8),))) == []
    # the table: the book entry in the job's partition, the join state in the host's
    host_rows = hosts.writes()
    assert {k: p for k, p, _v in jobs.writes()} == {"job/a": jobs.partition("a")}
    assert {k: p for k, p, _v in host_rows} == {"run/a": hosts.partition("h7")}
    rows = [(k, v) for k, _p, v in host_rows]
    other = state(observe_s=100.0)
    other.restore(rows, owned={(hosts.partition("h7") + 1) % 4})  # holds none of it: nothing taken
    assert "a" not in other.join
    back = state(observe_s=100.0)
    back.restore(rows, owned={hosts.partition("h7")})
    (o, err), = end(jobs, JobEvent(job="a", ts=20.0, kind="finished", exit_code=0), host_side=back)
    assert o.observed["cpu_cores"] == pytest.approx(0.5) and o.predicted["cpu_cores"] == pred.cpu_cores.mean
    assert "a" not in jobs.book and "a" not in back.join and back.model.jobs == 1 and jobs.model.jobs == 0


def test_a_join_state_one_worker_wrote_for_both_sides_is_restored_to_both():
    """A table written when one worker kept a job's join state under ``job/<id>``: the job is booked (its
    end is routed) and joined (learned at that end)."""
    st = state(observe_s=100.0)
    run(st, "a", 0.5, 0.0, n=3)
    legacy = [("job/a", encode_json(st.join.state("a")))]
    back = state(observe_s=100.0)
    back.restore(legacy)
    assert back.book["a"]["h"] == "h" and "a" in back.join
    (o, _err), = end(back, JobEvent(job="a", ts=5.0, kind="finished"))
    assert o.observed["cpu_cores"] == pytest.approx(0.5)


def encode_json(v) -> bytes:
    import json

    return json.dumps(v).encode()
