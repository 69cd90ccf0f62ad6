"""The placement agent's state without Faust: nodes from samples, the prediction wait, priorities, restart."""

from __future__ import annotations

import pytest

from phasewise.kit.job_signing import START_FIELDS, sign_event, spec_of
from phasewise.kit.records import (
    GpuSample,
    HostSamples,
    Interval,
    JobEvent,
    JobRequests,
    JobSpec,
    UtilisationPrediction,
)
from phasewise.kit.settings import Settings
from phasewise.models.jobs.placement.state import NotTrusted, PlacementState
from phasewise.streams.config import placement_state_config, submissions
from tests.job_keys import KEY, TRUSTED

GIB = 1 << 30


def _sample(host: str, cpus: int = 8, gpus: int = 2, util: float = 0.0, cpu_used: float = 0.5) -> HostSamples:
    return HostSamples(host=host, ts=100.0, interval_s=1.0, host_cpu_count=cpus, host_cpu_cores=cpu_used,
                       host_mem_bytes=2 * GIB, host_mem_total_bytes=32 * GIB,
                       gpus=tuple(GpuSample(index=i, uuid=f"GPU-{host}-{i}", util=util, mem_used_bytes=GIB,
                                            mem_total_bytes=16 * GIB) for i in range(gpus)))


def _job(name: str, gpus: float = 0.5, priority: int = 0, cpu: float | None = 2.0, ts: float = 1.0) -> JobEvent:
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32, command=("python", "-c", "pass"),
                   requests=JobRequests(cpu_cores=cpu, mem_bytes=2 * GIB, gpus=gpus, gpu_mem_bytes=4 * GIB))
    return sign_event(KEY, JobEvent(job=name, ts=ts, kind="submitted", priority=priority, spec=spec))


def _pred(job: str, util: float) -> UtilisationPrediction:
    iv = lambda m: Interval(mean=m, lo=m * 0.8, hi=m * 1.2)  # noqa: E731
    return UtilisationPrediction(job=job, ts=1.0, model_version=7, gpu_util=iv(util), gpu_mem_bytes=iv(3 * GIB),
                                 cpu_cores=iv(1.5), mem_bytes=iv(GIB), coverage=0.8)


def _state(**kw) -> PlacementState:
    """The state the placement agent builds from these settings (``place_*``, ``priority_*``, ``job_*``)."""
    settings = Settings.from_env({"host": "here", **kw}, env={})
    return PlacementState(placement_state_config(settings), submissions(settings))


def test_waits_for_the_prediction_then_places_with_it():
    s = _state(place_prediction_wait_s=5.0)
    s.samples(_sample("h1")), s.samples(_sample("h2", util=100.0))
    s.submitted(_job("a"), now=0.0)
    assert s.decide(now=1.0, ts=10.0) == []  # still waiting for its prediction
    s.prediction(_pred("a", 40.0))
    [(d, p)] = s.decide(now=1.0, ts=10.0)
    # h2's GPUs are observed at 100 %: (100 + 40 - 100) / 100 * 1.6 = 0.64 over capacity, h1 none; the
    # two hosts are alike, so the fragmentation growth is the same on both
    assert d.action == "place" and d.container == "a" and d.host == "h1"
    assert d.details["scores"]["h2"] - d.details["scores"]["h1"] == pytest.approx(0.64)
    assert "over capacity 0," in d.reason
    assert d.details["used"]["prediction"]["gpu_util"] == 40.0 and "predicted GPU util 40%" in d.reason
    assert d.details["device"] == list(p.gpus) and d.details["spec"]["command"] == ["python", "-c", "pass"]
    assert d.policy == "horus" and set(d.details["scores"]) == {"h1", "h2"}
    # what the actuator verifies, copied from the submitted event; no command of the agent's own
    x = d.details
    assert set(START_FIELDS) <= set(x) and "command" not in x and (x["job"], x["job_ts"]) == ("a", 1.0)
    assert TRUSTED.verify(x["job"], x["job_ts"], x["workload"], x["priority"], spec_of(x["spec"]),
                          x["job_signature"]) is None


def test_without_a_prediction_after_the_wait_requests_only():
    s = _state(place_prediction_wait_s=2.0)
    s.samples(_sample("h1"))
    s.submitted(_job("a", cpu=None), now=0.0)
    [(d, _)] = s.decide(now=2.5, ts=10.0)
    assert "no prediction" in d.reason and d.details["cpu_milli"] == 1000  # default core booked


def test_priority_first_and_waiting_then_freed():
    s = _state(place_prediction_wait_s=0.0)
    s.samples(_sample("h1", gpus=1))
    s.submitted(_job("low", gpus=1, priority=0, ts=1.0), now=0.0)
    s.submitted(_job("high", gpus=1, priority=9, ts=2.0), now=0.0)
    [(d, _)] = s.decide(now=0.0, ts=10.0)
    assert d.container == "high" and list(s.waiting) == ["low"]
    s.finished("high")
    [(d2, _)] = s.decide(now=0.0, ts=11.0)
    assert d2.container == "low" and not s.waiting


def test_a_waiting_job_gets_one_waiting_event_per_reason_and_none_once_placed():
    s = _state(place_prediction_wait_s=0.0)
    s.samples(_sample("h1", gpus=1))
    s.submitted(_job("low", gpus=1, priority=0, ts=1.0), now=0.0)
    s.submitted(_job("high", gpus=1, priority=9, ts=2.0), now=0.0)
    s.decide(now=0.0, ts=10.0)
    [w] = s.take_waits()
    assert (w.job, w.kind, w.ts) == ("low", "waiting", 10.0) and "no node has enough 1 GPU(s)" in w.reason
    s.retry.add("low")
    assert s.decide(now=0.0, ts=12.0) == [] and s.take_waits() == []  # the same reason: said once
    s.finished("high")
    s.decide(now=0.0, ts=13.0)
    assert s.take_waits() == [] and "low" in s.placed


def test_local_mode_slices_and_cpusets():
    s = _state(place_prediction_wait_s=0.0, place_local_nodes="s0=0-1@0;s1=2-3@1", place_policy="first-fit")
    assert not s.samples(_sample("elsewhere"))  # another host's sample does not describe the slices
    s.samples(_sample("here", cpus=4))
    s.submitted(_job("a", gpus=1, cpu=1.0), now=0.0)
    s.submitted(_job("b", gpus=1, cpu=1.0), now=0.0)
    made = s.decide(now=0.0, ts=10.0)
    got = {d.container: (d.host, d.details["node"], d.details["cpuset"], d.details["device"]) for d, _ in made}
    assert got == {"a": ("here", "s0", "0-1", [0]), "b": ("here", "s1", "2-3", [0])}


def test_restart_books_placed_jobs_again():
    s = _state(place_prediction_wait_s=0.0)
    s.samples(_sample("h1", gpus=1))
    s.submitted(_job("a", gpus=1), now=0.0)
    s.decide(now=0.0, ts=1.0)
    table = {k: v for k, _p, v in s.writes()}
    s2 = _state(place_prediction_wait_s=0.0)
    s2.restore(table.items())
    assert s2.placed == {"a": {"node": "h1", "gpus": [0], "ts": 1.0, "start_by": 301.0}}  # its lost deadline too
    assert s2.start_by == {"a": 301.0}
    s2.samples(_sample("h1", gpus=1))
    s2.submitted(_job("b", gpus=1), now=0.0)
    assert s2.decide(now=0.0, ts=2.0) == [] and list(s2.waiting) == ["b"]  # a's GPU stays booked
    with pytest.raises(ValueError, match="needs a spec"):
        s2.submitted(JobEvent(job="c", ts=1.0, kind="submitted"), now=0.0)


def test_a_prediction_before_its_job_means_no_wait():
    s = _state(place_prediction_wait_s=60.0)
    s.samples(_sample("h1"))
    s.prediction(_pred("a", 30.0))
    s.submitted(_job("a"), now=0.0)
    [(d, _)] = s.decide(now=0.0, ts=1.0)
    assert "predicted GPU util 30%" in d.reason


def test_horus_fragmentation_weight_setting_reaches_the_policy():
    s = _state(place_horus_frag_weight=0.0)
    assert s.config.cluster.horus_frag_weight == 0.0 and s.cluster.config.horus_frag_weight == 0.0
    s.samples(_sample("h1")), s.samples(_sample("h2", util=100.0))
    s.prediction(_pred("a", 40.0))
    s.submitted(_job("a"), now=0.0)
    [(d, _)] = s.decide(now=0.0, ts=10.0)
    # Horus's cost alone: the util term |0 + 40 - 100| / 100 = 0.6 on h1; |100 + 40 - 100| / 100 * 1.6 = 0.64 on h2
    assert d.host == "h1" and d.details["scores"]["h2"] - d.details["scores"]["h1"] == pytest.approx(0.04)
    assert _state().config.cluster.horus_frag_weight == 1.0


# ------------------------------------------------------------------ after admission (priority_launcher=place)

def _admitted(job: str, host: str, ts: float = 5.0, resume: bool = False, container: str | None = None,
              priority: int = 0) -> JobEvent:
    return JobEvent(job=job, ts=ts, kind="admitted", host=host, resume=resume, container=container,
                    priority=priority)


def test_after_admission_a_job_is_held_until_admitted_then_placed_on_that_host_only():
    s = _state(place_prediction_wait_s=0.0, place_after_admission=True)
    assert s.acts_on == {"submitted", "started", "scaled", "finished", "failed", "rejected", "lost", "terminated",
                         "admitted", "stopped", "frozen", "thawed"}
    # (without: the hints are not its concern)
    assert _state().acts_on == {"submitted", "started", "scaled", "finished", "failed", "rejected", "lost",
                                "terminated"}
    s.samples(_sample("h1", gpus=1)), s.samples(_sample("h2", gpus=1, util=90.0))
    s.submitted(_job("a", gpus=1), now=0.0)
    assert s.decide(now=1.0, ts=10.0) == [] and not s.waiting and not s.pending(1.0)  # held, not waiting
    s.admitted(_admitted("a", "h2"))  # h1 is the better node; the priority agent admitted it on h2
    assert s.pending(1.0)
    [(d, p)] = s.decide(now=1.0, ts=11.0)
    first_id = d.id
    assert (d.action, d.host, d.container, p.node, d.details["device"]) == ("place", "h2", "a", "h2", [0])
    assert d.details["resume"] is False and d.details["admitted_host"] == "h2"
    assert d.details["spec"]["command"] == ["python", "-c", "pass"] and "admitted on h2" in d.reason
    # another job admitted on h2 waits for room there, with the reason, though h1 is free
    s.submitted(_job("b", gpus=1, ts=2.0), now=0.0)
    s.admitted(_admitted("b", "h2", ts=6.0))
    assert s.decide(now=1.0, ts=12.0) == [] and list(s.waiting) == ["b"]
    assert s.why["b"].startswith("no room on h2, where the priority agent admitted it (it is placed there only)")
    # stopped (checkpoint-and-exit): a's booking frees, b is placed; a waits for its next admission
    s.stopped("a")
    assert "a" not in s.placed and s.cluster.allocs.keys() == set()
    [(d, _)] = s.decide(now=1.0, ts=13.0)
    assert (d.container, d.host) == ("b", "h2")
    assert s.decide(now=1.0, ts=13.5) == []  # a: held again
    s.finished("b")
    s.admitted(_admitted("a", "h2", ts=9.0, resume=True, container="a-ctr"))
    [(d, _)] = s.decide(now=1.0, ts=14.0)
    assert (d.container, d.host, d.details["resume"], d.details["job"]) == ("a-ctr", "h2", True, "a")
    assert d.details["spec"]["command"] == ["python", "-c", "pass"] and "(resume)" in d.reason
    assert d.id != first_id  # the same node and GPU, but a restart is a decision of its own (the actuator's id)
    # admitted again while placed: a redelivered hint, nothing placed twice
    s.admitted(_admitted("a", "h2", ts=9.0, resume=True, container="a-ctr"))
    assert s.decide(now=1.0, ts=15.0) == []


@pytest.mark.parametrize("kind", ["terminated", "finished", "failed"])
def test_after_admission_any_end_of_a_job_the_priority_agent_stopped_is_that_stops_exit(kind):
    """A job that honours the stop's checkpoint_exit control before the actuator handles the terminate decision
    is reported finished or failed, not terminated: it is kept all the same and placed again when admitted
    again; an end after its next start takes it out."""
    s = _state(place_prediction_wait_s=0.0, place_after_admission=True)
    s.samples(_sample("h1", gpus=1))
    s.submitted(_job("a", gpus=1), now=0.0)
    s.admitted(_admitted("a", "h1"))
    [(d, _)] = s.decide(now=1.0, ts=10.0)
    s.job_event(JobEvent(job="a", ts=10.5, kind="started", host="h1", container="a"), now=1.0)
    s.stopped("a", ts=11.0)
    s.job_event(JobEvent(job="a", ts=11.5, kind=kind, exit_code=None if kind == "terminated" else 0), now=1.0)
    assert s.holds("a") and "a" in s.events
    s.admitted(_admitted("a", "h1", ts=12.0, resume=True, container="a"))
    [(d, _)] = s.decide(now=1.0, ts=13.0)
    assert (d.container, d.details["resume"]) == ("a", True)
    s.job_event(JobEvent(job="a", ts=13.5, kind="started", host="h1", container="a"), now=1.0)
    s.job_event(JobEvent(job="a", ts=20.0, kind="finished", exit_code=0), now=1.0)
    assert not s.holds("a") and s.cluster.allocs.keys() == set()


def test_after_admission_an_unknown_host_or_an_admission_before_the_submission():
    s = _state(place_prediction_wait_s=0.0, place_after_admission=True)
    s.samples(_sample("h1"))
    s.admitted(_admitted("x", "h1"))  # its submitted event is on another partition, not read yet
    assert s.decide(now=0.0, ts=1.0) == []
    s.submitted(_job("x"), now=0.0)
    [(d, _)] = s.decide(now=0.0, ts=2.0)
    assert d.host == "h1"
    s.submitted(_job("y"), now=0.0)
    s.admitted(_admitted("y", "nowhere"))
    assert s.decide(now=0.0, ts=3.0) == [] and "no room on nowhere" in s.why["y"]
    with pytest.raises(ValueError, match="needs a host"):
        s.admitted(JobEvent(job="z", ts=1.0, kind="admitted"))


def test_after_admission_local_slices_of_the_admitted_host_only():
    s = _state(place_prediction_wait_s=0.0, place_after_admission=True, place_local_nodes="s0=0-1@0;s1=2-3@1")
    s.samples(_sample("here", gpus=2)), s.samples(_sample("elsewhere", gpus=2))
    s.submitted(_job("a"), now=0.0), s.submitted(_job("b"), now=0.0)
    s.admitted(_admitted("a", "here")), s.admitted(_admitted("b", "elsewhere"))
    [(d, _)] = s.decide(now=0.0, ts=1.0)
    assert (d.container, d.host, d.details["node"], d.details["cpuset"]) == ("a", "here", "s0", "0-1")
    assert list(s.waiting) == ["b"]  # admitted on a host whose slices this agent does not hold


def test_after_admission_the_state_keeps_the_admission_across_a_restart():
    s = _state(place_prediction_wait_s=0.0, place_after_admission=True)
    s.samples(_sample("h1", gpus=1))
    for i, j in enumerate(("placed", "admitted", "held")):
        s.submitted(_job(j, gpus=1, ts=float(i)), now=0.0)
    s.admitted(_admitted("placed", "h1")), s.admitted(_admitted("admitted", "h1"))
    s.admitted(_admitted("early", "h1"))  # admitted, not submitted yet
    [(d, _)] = s.decide(now=0.0, ts=1.0)
    assert d.container == "placed" and list(s.waiting) == ["admitted"]
    table = {k: v for k, _p, v in s.writes()}
    t = _state(place_prediction_wait_s=0.0, place_after_admission=True)
    t.restore(table.items())
    assert set(t.admission) == {"placed", "admitted", "early"} and set(t.placed) == {"placed"}
    t.samples(_sample("h1", gpus=1))  # the placed job is booked again: nothing else fits
    assert t.decide(now=0.0, ts=2.0) == [] and set(t.waiting) == {"admitted"}
    t.stopped("placed")
    [(d, _)] = t.decide(now=0.0, ts=3.0)
    assert d.container == "admitted"  # not held: its admission was restored; "held" still waits for one
    # the submission as signed came back with the state: the actuator can still verify the start
    x = d.details
    assert TRUSTED.verify(x["job"], x["job_ts"], x["workload"], x["priority"], spec_of(x["spec"]),
                          x["job_signature"]) is None
    t.finished("admitted")
    t.submitted(_job("early", gpus=1), now=0.0)
    [(d, _)] = t.decide(now=0.0, ts=4.0)
    assert d.container == "early" and "held" not in t.placed and "held" not in t.waiting


def test_after_admission_a_stale_stopped_hint_frees_nothing_and_each_placement_carries_its_weight():
    s = _state(place_prediction_wait_s=0.0, place_after_admission=True)
    s.samples(_sample("h1", gpus=1))
    s.submitted(_job("a", gpus=1), now=0.0)
    s.admitted(_admitted("a", "h1", ts=5.0, priority=5))
    [(d, _)] = s.decide(now=1.0, ts=10.0)
    w = s.start_weight(d)  # the priority agent's rule: it cannot send it before the container exists
    assert (w.action, w.host, w.container, w.details["cpu_weight"]) == ("weight", "h1", "a", 3200)
    assert w.reason == "cpu weight 3200: priority 5 training (100 x 2^(5 + 0/3), within [1, 10000]); started"
    s.stopped("a", ts=6.0)
    s.admitted(_admitted("a", "h1", ts=7.0, resume=True, priority=5))
    [(d, _)] = s.decide(now=1.0, ts=11.0)
    assert d.details["resume"] is True and s.start_weight(d).reason.endswith("; restarted")
    # the stopped hint sent again by a restarted priority worker (stamped before this admission): ignored
    s.stopped("a", ts=6.0)
    assert "a" in s.placed and s.cluster.allocs.keys() == {"a"}
    # weights off, or without admission: no weight decision
    off = _state(place_prediction_wait_s=0.0, place_after_admission=True, priority_cpu_weights=False)
    assert off.weight_ratio is None and _state().weight_ratio is None


def test_with_trusted_submitters_a_job_no_trusted_submitter_signed_books_nothing(tmp_path):
    from tests.job_keys import STRANGER, write_public

    write_public(tmp_path / "alice.pub", KEY)
    s = _state(place_prediction_wait_s=0.0, job_trusted_submitters=str(tmp_path / "alice.pub"))
    s.samples(_sample("h1", gpus=1))
    unsigned = JobEvent(job="u", ts=1.0, kind="submitted", spec=_job("u").spec)
    stranger = sign_event(STRANGER, JobEvent(job="x", ts=1.0, kind="submitted", spec=_job("x").spec))
    with pytest.raises(NotTrusted, match="'u' refused: the job is not signed by a submitter"):
        s.submitted(unsigned, now=0.0)
    with pytest.raises(NotTrusted, match="'x' refused: signed by submitter key .* which is not trusted"):
        s.submitted(stranger, now=0.0)
    assert s.decide(now=1.0, ts=2.0) == [] and not s.events
    s.submitted(_job("a", gpus=1), now=0.0)
    [(d, _)] = s.decide(now=1.0, ts=2.0)
    assert d.container == "a"


# ------------------------------------------------------------------ waiting jobs: retried where room came, capped

class Counting:
    """The state's policy, counting the jobs it is asked to place."""

    def __init__(self, policy) -> None:
        self.policy, self.asked = policy, []
        self.name = policy.name

    def place(self, job, cluster):
        self.asked.append(job.job)
        return self.policy.place(job, cluster)


def test_a_freed_booking_retries_only_the_waiting_jobs_it_could_fit():
    s = _state(place_prediction_wait_s=0.0, place_policy="first-fit")
    s.samples(_sample("g", cpus=8, gpus=1)), s.samples(_sample("c", cpus=8, gpus=0))
    s.submitted(_job("a", gpus=1), now=0.0)
    [(d, _)] = s.decide(now=0.0, ts=1.0)
    assert d.host == "g"
    for i in range(40):  # 40 want the GPU a holds, 40 want more cores than any node has
        s.submitted(_job(f"gpu{i:02d}", gpus=1, ts=2.0 + i), now=0.0)
        s.submitted(_job(f"wide{i:02d}", gpus=0, cpu=64.0, ts=2.0 + i), now=0.0)
    s.policy = counting = Counting(s.policy)
    assert s.decide(now=0.0, ts=2.0) == [] and len(s.waiting) == 80
    assert len(counting.asked) == 2  # each need tried once: the others of the same need cannot fit either
    assert s.queue.needs() == 2
    counting.asked.clear()
    s.submitted(_job("small", gpus=0, cpu=1.0, ts=99.0), now=0.0)  # a new job: no waiting job is tried
    [(d, _)] = s.decide(now=0.0, ts=3.0)
    assert d.container == "small" and counting.asked == ["small"]
    counting.asked.clear()
    s.samples(_sample("c", cpus=8, gpus=0, cpu_used=0.1))  # a node without a GPU and 8 cores: fits neither
    assert s.decide(now=0.0, ts=4.0) == [] and counting.asked == []
    s.finished("a")  # the GPU frees: the first GPU job takes it; the next fits nowhere, known without the policy
    [(d, _)] = s.decide(now=0.0, ts=5.0)
    assert d.container == "gpu00" and counting.asked == ["gpu00"]
    assert len(s.waiting) == 79 and "gpu00" not in s.queue and "no node has enough 1 GPU(s)" in s.why["gpu01"]
    s.prediction(_pred("wide05", 50.0))  # what it needs may change: tried again whatever the nodes
    counting.asked.clear()
    assert s.decide(now=0.0, ts=6.0) == [] and counting.asked == ["wide05"]


def test_retrying_only_where_room_came_places_exactly_what_retrying_every_waiting_job_would():
    """The index changes which jobs are tried, never the decisions: a random cluster of bookings and
    frees, decided both ways."""
    import random

    def run(retry_all: bool) -> list[tuple[str, str, tuple]]:
        rng = random.Random(5)
        s = _state(place_prediction_wait_s=0.0)
        for h in range(6):
            s.samples(_sample(f"h{h}", cpus=rng.choice([4, 8, 16]), gpus=rng.choice([0, 1, 2, 4])))
        made, running, waited = [], [], set()
        for step in range(160):
            r = rng.random()
            if r < 0.55:
                s.submitted(_job(f"j{step}", gpus=rng.choice([0, 0, 0.25, 0.5, 1, 2]), priority=rng.randint(0, 2),
                                 cpu=float(rng.choice([2, 4, 8, 12])), ts=float(step)), now=0.0)
            elif r < 0.85 and running:
                s.finished(running.pop(rng.randrange(len(running))))
            else:
                h = rng.randrange(6)
                s.samples(_sample(f"h{h}", cpus=16, gpus=4, util=rng.uniform(0, 90), cpu_used=rng.uniform(0, 4)))
            if retry_all:
                s.retry.update(s.waiting)  # what the agent did before: every waiting job at every decision
            for d, p in s.decide(now=0.0, ts=float(step)):
                made.append((step, d.container, d.host, tuple(p.gpus), d.container in waited))
                running.append(d.container)
            waited |= set(s.waiting)
        return made

    fast, every = run(False), run(True)
    assert fast == every
    late = [m for m in fast if m[-1]]  # placed after waiting: with a GPU and without
    assert len(fast) > 50 and any(m[3] for m in late) and any(not m[3] for m in late)


def test_at_most_place_max_waiting_jobs_wait_and_the_one_of_lowest_rank_is_refused_with_the_reason():
    s = _state(place_prediction_wait_s=0.0, place_max_waiting_jobs=3)
    s.samples(_sample("h1", gpus=1))
    s.submitted(_job("running", gpus=1), now=0.0)
    s.decide(now=0.0, ts=1.0)
    for i, prio in enumerate((1, 0, 2)):
        s.submitted(_job(f"w{i}", gpus=1, priority=prio, ts=10.0 + i), now=0.0)
    s.decide(now=0.0, ts=2.0)
    assert set(s.waiting) == {"w0", "w1", "w2"} and s.take_refused() == []
    s.submitted(_job("late", gpus=1, priority=0, ts=20.0), now=0.0)  # ranks last: refused itself
    s.decide(now=0.0, ts=3.0)
    [(ev, why)] = s.take_refused()
    assert ev.job == "late" and set(s.waiting) == {"w0", "w1", "w2"} and "late" not in s.events
    assert "place_max_waiting_jobs 3" in why and "refused, not kept; submit it again later" in why
    s.submitted(_job("urgent", gpus=1, priority=5, ts=21.0), now=0.0)  # outranks w1 (priority 0): w1 goes
    s.decide(now=0.0, ts=4.0)
    [(ev, why)] = s.take_refused()
    assert ev.job == "w1" and "job urgent, of higher priority or submitted earlier, came" in why
    assert set(s.waiting) == {"w0", "w2", "urgent"} and {k: v for k, _p, v in s.writes()}["job/w1"] is None
    s.finished("running")
    [(d, _)] = s.decide(now=0.0, ts=5.0)
    assert d.container == "urgent"


def test_horus_outcome_of_an_ended_job_is_not_held():
    """A learned job's prediction published again with what was observed (docs/horus.md): taken while the
    job is held, left alone once it ended."""
    import dataclasses

    s = _state(place_prediction_wait_s=5.0)
    s.samples(_sample("h1"))
    s.submitted(_job("a"), now=0.0)
    learned = dataclasses.replace(_pred("a", 40.0), observed={"gpu_util": 35.0}, log_error={"gpu_util": 0.13})
    s.prediction(learned)
    assert s.predictions["a"] == learned
    s.prediction(dataclasses.replace(learned, job="gone"))
    assert "gone" not in s.predictions


def test_a_services_replicas_are_booked_on_its_node_and_freed_with_it_across_a_restart():
    s = _state(place_prediction_wait_s=0.0)
    s.samples(_sample("h1", cpus=8, gpus=0))
    s.submitted(_job("svc", gpus=0, cpu=2.0), now=0.0)
    [(d, _)] = s.decide(now=0.0, ts=1.0)
    i = s.cluster.index["h1"]
    s.job_event(JobEvent(job="svc", ts=2.0, kind="started", host="h1", container="svc", pid=7), now=0.0)
    assert s.cluster.cpu_alloc[i] == 2000
    scaled = lambda n, ts, host="h1": JobEvent(job="svc", ts=ts, kind="scaled", host=host,  # noqa: E731
                                               container="svc", replicas=n, max_replicas=4, workload="inference")
    s.job_event(scaled(3, 3.0), now=0.0)
    assert s.cluster.cpu_alloc[i] == 6000 and s.cluster.mem_alloc[i] == 6 * GIB
    s.job_event(scaled(3, 3.5), now=0.0)                      # the same count again: nothing more
    assert s.cluster.cpu_alloc[i] == 6000
    s.job_event(scaled(5, 3.6, host=None), now=0.0)            # a Deployment's pods: Kubernetes places them
    assert s.cluster.cpu_alloc[i] == 6000
    # a job of 3 cores no longer fits beside the three replicas (8 - 6 = 2 cores free)
    s.submitted(_job("big", gpus=0, cpu=3.0), now=0.0)
    assert s.decide(now=0.0, ts=4.0) == [] and "big" in s.waiting
    # restarted: the three replicas are booked again
    table = {k: v for k, _p, v in s.writes()}
    s2 = _state(place_prediction_wait_s=0.0)
    s2.restore(table.items())
    s2.samples(_sample("h1", cpus=8, gpus=0))
    assert s2.cluster.cpu_alloc[s2.cluster.index["h1"]] == 6000
    # one replica again: two replicas' room frees and the waiting job is placed
    s.job_event(scaled(1, 5.0), now=0.0)
    assert s.cluster.cpu_alloc[i] == 2000
    [(d, _)] = s.decide(now=0.0, ts=6.0)
    assert d.container == "big"
    s.job_event(JobEvent(job="svc", ts=7.0, kind="finished", exit_code=0), now=0.0)
    assert s.cluster.cpu_alloc[i] == 3000                       # only big's booking left


def test_after_admission_a_frozen_job_keeps_its_memory_booked_and_frees_its_cpus_and_gpus():
    s = _state(place_prediction_wait_s=0.0, place_after_admission=True)
    s.samples(_sample("h1", cpus=4, gpus=1))
    s.submitted(_job("low", gpus=1, cpu=3.0), now=0.0)
    s.admitted(_admitted("low", "h1"))
    [(d, _)] = s.decide(now=1.0, ts=10.0)
    s.job_event(JobEvent(job="low", ts=11.0, kind="started", host="h1", container="low", pid=9), now=1.0)
    i = s.cluster.index["h1"]
    # the priority agent freezes low and admits high on h1: placement must see low's CPUs and GPU free
    s.submitted(_job("high", gpus=1, cpu=3.0, priority=9, ts=2.0), now=0.0)
    s.admitted(_admitted("high", "h1", ts=12.0, priority=9))
    assert s.decide(now=1.0, ts=12.5) == [] and list(s.waiting) == ["high"]   # (before the freeze: no room)
    s.job_event(JobEvent(job="low", ts=13.0, kind="frozen", host="h1", container="low"), now=1.0)
    assert (s.cluster.cpu_alloc[i], s.cluster.mem_alloc[i], s.cluster.milli_alloc[i, 0]) == (0, 2 * GIB, 0)
    [(d, _)] = s.decide(now=1.0, ts=14.0)
    assert (d.container, d.host) == ("high", "h1")
    assert (s.cluster.cpu_alloc[i], s.cluster.mem_alloc[i]) == (3000, 4 * GIB)
    # restarted: low is still booked as frozen (memory only)
    table = {k: v for k, _p, v in s.writes()}
    s2 = _state(place_prediction_wait_s=0.0, place_after_admission=True)
    s2.restore(table.items())
    s2.samples(_sample("h1", cpus=4, gpus=1))
    assert (s2.cluster.cpu_alloc[i], s2.cluster.mem_alloc[i], s2.cluster.milli_alloc[i, 0]) == (3000, 4 * GIB, 1000)
    # high ends and low is thawed: all of low is booked again
    s.job_event(JobEvent(job="high", ts=20.0, kind="finished", exit_code=0), now=1.0)
    s.job_event(JobEvent(job="low", ts=21.0, kind="thawed", host="h1", container="low"), now=1.0)
    s.job_event(JobEvent(job="low", ts=21.5, kind="thawed", host="h1", container="low"), now=1.0)  # (again)
    assert (s.cluster.cpu_alloc[i], s.cluster.mem_alloc[i], s.cluster.milli_alloc[i, 0]) == (3000, 2 * GIB, 1000)
