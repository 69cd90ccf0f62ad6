"""The placement agent's state, one record at a time: nodes from samples, jobs waiting, placed and held.

:class:`PlacementState` takes the records the placement agent decodes (host samples, job events,
predictions) and returns ``place`` decisions (:meth:`PlacementState.decide`); it holds the
:class:`~phasewise.models.jobs.placement.cluster.Cluster`, the policy, the waiting jobs' index and the
table records the agent writes at its commits. Time comes in as arguments (``now``: a monotonic clock
for the prediction wait, ``ts``: event time for the decisions). Narrative: docs/placement.md, "The
placement worker".
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from phasewise.kit.records import TERMINAL_KINDS, Decision, HostSamples, JobEvent, UtilisationPrediction, decode, encode
from phasewise.kit.records.jobs import MAX_REASON
from phasewise.models.jobs.events import Refused
from phasewise.models.jobs.lifecycle import STOP_EXITS, Lifecycle, submission_problem
from phasewise.models.jobs.placement.cluster import Cluster, Gpu, Job, Node, Placement, PlacementConfig
from phasewise.models.jobs.placement.policies import make_policy, why_not
from phasewise.models.jobs.placement.waiting import WaitingJobs, need_of
from phasewise.models.jobs.priorities import to_decision, weight_action
from phasewise.models.jobs.submissions import Submissions

__all__ = ["DEFAULT_CPU_MILLI", "HOST_LABEL", "MAX_PREDICTIONS", "NotTrusted", "PlacementState",
           "PlacementStateConfig", "cpu_count"]

log = logging.getLogger(__name__)

MAX_PREDICTIONS = 100_000  # predictions held at most (those of jobs not submitted here go first)
DEFAULT_CPU_MILLI = 1000  # a job that requests no CPU and has no prediction yet is booked one core
#: after admission: the node label naming a node's host (a job admitted on a host selects it)
HOST_LABEL = "phasewise/host"


@dataclass(frozen=True)
class PlacementStateConfig:
    """The placement agent's parameters (:func:`phasewise.streams.config.placement_state_config` maps the
    ``place_*`` settings onto them)."""

    #: this worker's host: local mode's nodes are its slices, and its decisions are for it
    host: str
    #: the policy by name (:data:`~phasewise.models.jobs.placement.policies.POLICIES`)
    policy: str
    #: the cluster's hard rules and the policies' weights
    cluster: PlacementConfig
    #: seconds a submitted job waits for its prediction
    prediction_wait_s: float
    #: jobs that may wait for room at most (0: no cap)
    max_waiting_jobs: int
    #: local mode: ``(name, cpuset, GPU indices)`` of each slice of this host (empty: a node per host)
    local_nodes: tuple[tuple[str, str, tuple[int, ...]], ...]
    #: the job-events topic's partition count (a job's record goes to the changelog partition of its key)
    partitions: int
    #: place only what the priority agent admitted, on the host it admitted it on
    after_admission: bool
    #: the priority agent's CPU weight ratio, sent with an admitted job's place decision (``None``: no weight)
    weight_ratio: float | None
    #: seconds after its place decision a placed job has to be reported ``started`` before its booking is
    #: released as ``lost`` (0: never)
    start_timeout_s: float


def cpu_count(cpuset: str) -> int:
    """CPUs in a cpuset list.

    >>> cpu_count("0-3,6")
    5
    """
    n = 0
    for r in cpuset.split(","):
        a, _, b = r.partition("-")
        n += (int(b) - int(a) + 1) if b else 1
    return n


class NotTrusted(ValueError):
    """A submission no trusted submitter signed (where the agent has ``job_trusted_submitters``)."""



class PlacementState:
    """Nodes, waiting and placed jobs, predictions, and the table records they make (the agents hold one).

    *submissions*: the start details a decision copies from a job's ``submitted`` event, and the trusted
    submitters' check (a refused submission raises :class:`NotTrusted` and books nothing).
    """

    def __init__(self, config: PlacementStateConfig, submissions: Submissions) -> None:
        self.config = config
        self.host = config.host
        self.policy_name = config.policy
        self.wait_s = config.prediction_wait_s
        self.max_waiting = config.max_waiting_jobs
        self.local = list(config.local_nodes)
        self.partitions = config.partitions
        #: place only what the priority agent admitted, on the host it admitted it on
        self.after_admission = config.after_admission
        #: the priority agent's CPU weight rule, sent with an admitted job's place decision
        self.weight_ratio = config.weight_ratio if config.after_admission else None
        #: the job-event kinds acted on (the others are skipped)
        self.acts_on = frozenset({"submitted", "started", "scaled", "terminated"} | TERMINAL_KINDS
                                 | ({"admitted", "stopped", "frozen", "thawed"} if config.after_admission else set()))
        self.start_timeout_s = config.start_timeout_s
        #: the jobs seen ending (kept across restores: a state read again after one is not counted twice)
        self.lifecycle = Lifecycle("place")
        #: the submitted event's start details, and the trusted submitters' check (``None``: every job)
        self.submissions = submissions
        self.reset()

    def reset(self) -> None:
        self.cluster = Cluster([], self.config.cluster)
        self.policy = make_policy(self.policy_name)
        self.events: dict[str, JobEvent] = {}  # submitted, not finished
        self.predictions: dict[str, UtilisationPrediction] = {}
        self.deadline: dict[str, float] = {}  # job -> monotonic time it is decided without a prediction
        self.waiting: dict[str, float] = {}  # job -> submission ts (decided, no node yet)
        self.placed: dict[str, dict] = {}  # job -> {"node", "gpus"}
        self.pending_bookings: dict[str, dict] = {}  # restored placements whose node is not known yet
        #: after admission: job -> its admitted hint {"host", "resume", "ts", "container"}, until stopped or finished
        self.admission: dict[str, dict] = {}
        #: after admission: the jobs the priority agent stopped to resume later, whose ``terminated`` is theirs
        self.resumable: set[str] = set()
        #: placed jobs not reported started yet -> the event time their booking is released as lost
        self.start_by: dict[str, float] = {}
        self.why: dict[str, str] = {}  # waiting job -> why no node takes it
        #: (job, why, event time) of each wait whose reason changed, for the agent to publish (:meth:`take_waits`)
        self.waits: list[tuple[str, str, float]] = []
        self.queue = WaitingJobs(self.config.cluster)  # the waiting jobs tried and not placed, by what they need
        self.retry: set[str] = set()  # waiting jobs to try again whatever the nodes (what they need changed)
        self.gained: set[str] = set()  # nodes that may have gained room since the last decisions
        #: jobs refused since the agent last took them: (their submitted event, why)
        self.refused: list[tuple[JobEvent, str]] = []
        self._writes: dict[str, tuple[int, bytes | None]] = {}  # key -> (partition, value) for the next commit
        self.seq = 0

    # -- table ---------------------------------------------------------------------------
    def put(self, job: str, value: Any) -> None:
        key = f"job/{job}"
        self._writes[key] = (zlib.crc32(key.encode()) % self.partitions,
                             None if value is None else json.dumps(value, separators=(",", ":")).encode())

    def _record(self, job: str) -> dict:
        return {"event": json.loads(encode(self.events[job])) if job in self.events else None,
                "placed": self.placed.get(job), "admitted": self.admission.get(job),
                "resumable": job in self.resumable,
                "prediction": json.loads(encode(self.predictions[job])) if job in self.predictions else None}

    def writes(self) -> list[tuple[str, int, bytes | None]]:
        """``(key, changelog partition, value or None)`` of the records changed since the last call."""
        out = [(k, p, v) for k, (p, v) in self._writes.items()]
        self._writes.clear()
        return out

    def restore(self, items: Any) -> int:
        self.reset()
        for k, raw in items:
            if raw is None or not k.startswith("job/"):
                continue
            v = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
            if v.get("admitted"):
                self.admission[k.removeprefix("job/")] = dict(v["admitted"])
            if v.get("resumable"):
                self.resumable.add(k.removeprefix("job/"))
            if v.get("event") is None:  # admitted before its submitted event was read
                continue
            ev = decode(JobEvent, json.dumps(v["event"]))
            self.events[ev.job] = ev
            if v.get("prediction"):
                self.predictions[ev.job] = decode(UtilisationPrediction, json.dumps(v["prediction"]))
            if v.get("placed"):
                self.placed[ev.job] = v["placed"]
                self.pending_bookings[ev.job] = v["placed"]
                if v["placed"].get("start_by") is not None:
                    self.start_by[ev.job] = float(v["placed"]["start_by"])
            elif self.after_admission and ev.job not in self.admission:
                self.deadline[ev.job] = 0.0  # held: decided once admitted
            else:
                self.waiting[ev.job] = ev.ts
                self.retry.add(ev.job)  # tried at the next decisions, then indexed
        log.info("restored %d placed, %d waiting and %d held jobs", len(self.placed), len(self.waiting),
                 len(self.deadline))
        return len(self.events)

    # -- inputs --------------------------------------------------------------------------
    def nodes_from(self, hs: HostSamples) -> list[Node]:
        """The nodes a host's sample describes (none when it lacks host capacity)."""
        if hs.host_cpu_count is None or hs.host_mem_total_bytes is None:
            return []
        gpus = {g.index: g for g in hs.gpus}
        host_label = ((HOST_LABEL, hs.host),) if self.after_admission else ()
        if not self.local:
            return [Node(hs.host, int(hs.host_cpu_count * 1000), int(hs.host_mem_total_bytes),
                         tuple(Gpu("", int(g.mem_total_bytes), float(g.util), int(g.mem_used_bytes))
                               for _, g in sorted(gpus.items())),
                         labels=host_label, cpu_used_milli=int((hs.host_cpu_cores or 0) * 1000),
                         mem_used_bytes=int(hs.host_mem_bytes or 0))]
        if hs.host != self.host:
            return []
        share = int(hs.host_mem_total_bytes // max(len(self.local), 1))
        return [Node(name, cpu_count(cpus) * 1000, share,
                     tuple(Gpu("", int(gpus[i].mem_total_bytes), float(gpus[i].util), int(gpus[i].mem_used_bytes))
                           for i in idx if i in gpus),
                     labels=(("cpuset", cpus), *host_label)) for name, cpus, idx in self.local]

    def samples(self, hs: HostSamples) -> bool:
        """Update the nodes; True when the cluster changed."""
        nodes = self.nodes_from(hs)
        if not nodes:
            return False
        self.cluster.upsert_many(nodes)
        self.gained.update(n.name for n in nodes)  # less use, more capacity or new: its waiting jobs may fit
        for job, b in list(self.pending_bookings.items()):
            if b["node"] in self.cluster.index:
                self.cluster.restore(self._job(job), b["node"], tuple(b["gpus"]))
                if int(b.get("replicas", 1)) > 1:
                    self.cluster.rescale(job, int(b["replicas"]))
                if b.get("frozen"):
                    self.cluster.freeze(job)
                del self.pending_bookings[job]
        return True

    def submitted(self, ev: JobEvent, now: float) -> None:
        if ev.spec is None:
            raise ValueError("a submitted event needs a spec")
        if self.submissions.check is not None:
            if (why := self.submissions.check(ev)) is not None:
                raise NotTrusted(f"JobEvent: submitted job {ev.job!r} refused: {why}")
        if (why := submission_problem(ev)) is not None:
            raise Refused(why)
        old = self.events.get(ev.job)
        if old is not None:
            if old == ev:
                return  # the same event read again (after a restart): nothing changes
            raise Refused(f"JobEvent: job id {ev.job!r} already submitted (at {old.ts:.3f}, "
                          f"{'placed' if ev.job in self.placed else 'waiting'}): this submission is refused; "
                          f"submit it under another id", "duplicate")
        ended = self.lifecycle.ended_as(ev.job)
        if ended is not None:
            if ended[2] == ev.ts:
                return  # its submission read again after it ended: it is not placed a second time
            raise Refused(f"JobEvent: job id {ev.job!r} already submitted (it ended: {ended[0]} at "
                          f"{ended[1]:.3f}): this submission is refused; submit it under another id", "duplicate")
        self.events[ev.job] = ev
        # its prediction may have come first (another topic): then no wait
        self.deadline[ev.job] = 0.0 if ev.job in self.predictions else now + self.wait_s
        self.put(ev.job, self._record(ev.job))

    def prediction(self, p: UtilisationPrediction) -> None:
        if p.observed and p.job not in self.events:
            return  # horus's outcome of a learned job not held here (it ended): nothing to place
        self.predictions.pop(p.job, None)
        self.predictions[p.job] = p
        while len(self.predictions) > MAX_PREDICTIONS:  # predictions of jobs never submitted here: oldest go
            old = next(j for j in self.predictions if j not in self.events or j == p.job)
            if old == p.job:
                break
            del self.predictions[old]
        if p.job in self.deadline:
            self.deadline[p.job] = 0.0  # decide at the next round
        elif p.job in self.waiting:
            self.retry.add(p.job)  # what it needs may have changed
        if p.job in self.events:
            self.put(p.job, self._record(p.job))

    def finished(self, job: str) -> None:
        """Forget *job*: what it booked frees, it is not decided again."""
        self._freed(self.cluster.release(job))
        for d in (self.events, self.predictions, self.deadline, self.waiting, self.placed, self.pending_bookings,
                  self.admission, self.why, self.start_by):
            d.pop(job, None)
        self.resumable.discard(job)
        self.queue.remove(job)
        self.retry.discard(job)
        self.put(job, None)

    def holds(self, job: str) -> bool:
        return job in self.events or job in self.placed or job in self.admission

    def _unheld(self, ev: JobEvent, why: str | None = None) -> None:
        why = why or self.lifecycle.unheld(ev.job, ev.kind, ev.ts)
        if why is not None:
            self.lifecycle.ignore(ev.job, ev.kind, why)

    def started(self, ev: JobEvent) -> None:
        """The actuator started *ev.job*: its booking is alive (no lost timeout any more)."""
        p = self.placed.get(ev.job)
        if p is None:
            self._unheld(ev, None if not self.holds(ev.job) else "not_placed")
            return
        if p.get("started") is not None:
            if p["started"] != ev.ts:
                self.lifecycle.ignore(ev.job, ev.kind, "repeated", f"started already at {p['started']:.3f}")
            return
        p["started"] = ev.ts
        p.pop("start_by", None)
        self.resumable.discard(ev.job)  # a terminated from now on ends this run
        self.start_by.pop(ev.job, None)
        self.put(ev.job, self._record(ev.job))

    def scaled(self, ev: JobEvent) -> None:
        """An inference service's actuator runs *ev.replicas* of it now: its booking is that many times one
        replica's (local replicas share the first one's node). A Deployment's pods (no host) are placed by
        Kubernetes and are not booked here."""
        p = self.placed.get(ev.job)
        if p is None:
            self._unheld(ev, None if not self.holds(ev.job) else "not_placed")
            return
        if ev.replicas is None or not ev.host or ev.host != (self.host if self.local else p["node"]):
            return
        n = max(1, ev.replicas)
        if int(p.get("replicas", 1)) == n:
            return
        if (node := self.cluster.rescale(ev.job, n)) is not None and n < int(p.get("replicas", 1)):
            self._freed(node)
        log.info("job %s runs %d replica(s) on %s: booked %d times", ev.job, n, p["node"], n)
        p["replicas"] = n
        self.put(ev.job, self._record(ev.job))

    def frozen(self, ev: JobEvent) -> None:
        """After admission: the actuator froze *ev.job* (the priority agent's freeze) or thawed it. A frozen
        job keeps its memory booked and frees its CPUs and GPUs, as the priority policy counts it, so that
        the job admitted in its place is placed; thawed, it books them again."""
        p = self.placed.get(ev.job)
        if p is None:
            self._unheld(ev, None if not self.holds(ev.job) else "not_placed")
            return
        frozen = ev.kind == "frozen"
        if bool(p.get("frozen")) == frozen:
            return  # (read again, or a thaw of a job not frozen here)
        if frozen:
            self._freed(self.cluster.freeze(ev.job))
            p["frozen"] = True
        else:
            self.cluster.thaw(ev.job)
            p.pop("frozen", None)
        log.info("job %s %s on %s: %s", ev.job, ev.kind, p["node"],
                 "its memory stays booked, its CPUs and GPUs are free" if frozen else "all it booked is booked again")
        self.put(ev.job, self._record(ev.job))

    def ended(self, ev: JobEvent) -> None:
        """A state that ends *ev.job* (:data:`~phasewise.kit.records.TERMINAL_KINDS`, or ``terminated``), unless
        it is the exit of the priority agent's own stop: what it booked frees and it is forgotten."""
        if not self.holds(ev.job):
            self._unheld(ev)
            return
        if ev.kind in STOP_EXITS and ev.job in self.resumable:
            # the priority agent stopped it to resume it (its booking freed then): the exit it asked for
            self.resumable.discard(ev.job)
            self.put(ev.job, self._record(ev.job))
            return
        p = self.placed.get(ev.job)
        if ev.kind == "rejected" and p is not None and p.get("started") is not None:
            self.lifecycle.ignore(ev.job, ev.kind, "after_start", ev.reason or "")
            return
        if p is not None and p.get("started") is None and ev.kind in ("finished", "failed", "terminated"):
            log.info("job %s: %s before its started event: its booking frees; a started event after it changes "
                     "nothing", ev.job, ev.kind)
        sub = self.events.get(ev.job)
        self.lifecycle.end(ev.job, ev.kind, ev.ts, sub.ts if sub is not None else None)
        log.info("job %s %s%s: %s", ev.job, ev.kind, f" ({ev.reason})" if ev.reason else "",
                 f"its booking on {p['node']} frees" if p else "forgotten")
        self.finished(ev.job)

    def expire(self, now: float) -> list[tuple[JobEvent, JobEvent | None]]:
        """Release the bookings of the placed jobs no ``started`` event reached within
        ``job_start_timeout_s`` of their place decision, by event time *now*: ``(its lost event, its
        submitted event)`` each, the lost event stamped *now* for the agent to publish."""
        out = []
        for job, t in sorted(self.start_by.items(), key=lambda x: (x[1], x[0])):
            if t > now:
                continue
            p = self.placed.get(job) or {}
            sub = self.events.get(job)
            a = self.admission.get(job) or {}
            node = p.get("node")
            reason = (f"no sign of life: no started event within job_start_timeout_s {self.start_timeout_s:g} s "
                      f"of its place decision at {float(p.get('ts', t - self.start_timeout_s)):.3f}"
                      f"{f' on {node}' if node else ''}; its booking is released")
            lost = JobEvent(job=job, ts=max(now, sub.ts if sub else 0.0), kind="lost",
                            host=(self.host if self.local else node) or None, container=a.get("container") or job,
                            reason=reason, workload=sub.workload if sub else "training",
                            priority=sub.priority if sub else 0)
            log.warning("job %s lost: %s", job, reason)
            self.lifecycle.end(job, "lost", lost.ts, sub.ts if sub else None)
            self.finished(job)
            out.append((lost, sub))
        return out

    def _freed(self, node: str | None) -> None:
        if node is not None:
            self.gained.add(node)

    def admitted(self, ev: JobEvent) -> None:
        """The priority agent admitted *ev.job* on *ev.host* (after admission only): it may be placed there."""
        if not ev.host:
            raise ValueError(f"an admitted event needs a host (job {ev.job!r})")
        if ev.job in self.placed:
            log.info("job %s admitted again while placed on %s: it keeps its placement until it is stopped",
                     ev.job, self.placed[ev.job]["node"])
            return
        self.admission[ev.job] = {"host": ev.host, "resume": bool(ev.resume), "ts": ev.ts,
                                  "container": ev.container or ev.job, "priority": ev.priority}
        if ev.job in self.events and ev.job not in self.waiting and ev.job not in self.deadline:
            self.deadline[ev.job] = 0.0
        elif ev.job in self.waiting:
            self.retry.add(ev.job)  # its priority and host may have changed
        self.put(ev.job, self._record(ev.job))

    def stopped(self, job: str, ts: float | None = None) -> None:
        """The priority agent stopped *job* (checkpoint-and-exit): what it booked frees, it waits to be admitted.

        A hint stamped before the job's admission (*ts*) is stale (sent again by a priority worker
        restarted before its commit, after the admission that resumed the job): ignored.
        """
        a = self.admission.get(job)
        if ts is not None and a is not None and ts < float(a.get("ts") or 0.0):
            log.info("job %s: stopped hint at %.3f is older than its admission at %.3f: ignored", job, ts, a["ts"])
            return
        was = self.placed.pop(job, None)
        self._freed(self.cluster.release(job))
        self.pending_bookings.pop(job, None)
        self.waiting.pop(job, None)
        self.queue.remove(job)
        self.retry.discard(job)
        self.why.pop(job, None)
        self.start_by.pop(job, None)
        if self.admission.pop(job, None) is None and was is None:
            return
        if was is not None:
            # its process exits as asked (or was never started): the terminated that follows is this stop's,
            # up to the started event of its next placement
            self.resumable.add(job)
        if job in self.events:
            self.deadline[job] = 0.0  # (decided once admitted again)
        self.put(job, self._record(job))

    def job_event(self, ev: JobEvent, now: float) -> None:
        """A job event of a kind in :attr:`acts_on` (the agent checked its signature and time);
        :class:`ValueError` (:class:`NotTrusted`) when it cannot be taken."""
        if ev.kind == "submitted":
            self.submitted(ev, now)
        elif ev.kind == "started":
            self.started(ev)
        elif ev.kind == "scaled":
            self.scaled(ev)
        elif ev.kind in TERMINAL_KINDS or ev.kind == "terminated":
            self.ended(ev)
        elif ev.kind == "admitted":
            self.admitted(ev)
        elif ev.kind in ("frozen", "thawed"):
            self.frozen(ev)
        else:  # stopped
            self.stopped(ev.job, ev.ts)

    def may_decide(self, job: str) -> bool:
        return not self.after_admission or job in self.admission

    def pending(self, now: float) -> bool:
        """Whether a job's prediction wait is over and it may be decided, or a waiting job is to be tried
        again (the timer decides then)."""
        return bool(self.retry) or any(t <= now and self.may_decide(j) for j, t in self.deadline.items())

    # -- decisions -----------------------------------------------------------------------
    def _job(self, job: str) -> Job:
        ev = self.events[job]
        spec = ev.spec
        r = spec.requests
        pred = self.predictions.get(job)
        cpu = r.cpu_cores if r.cpu_cores is not None else (pred.cpu_cores.hi if pred else None)
        mem = r.mem_bytes if r.mem_bytes is not None else (pred.mem_bytes.hi if pred else 0)
        gmem = r.gpu_mem_bytes if r.gpu_mem_bytes is not None else (pred.gpu_mem_bytes.hi if pred else 0)
        gpus = r.gpus if r.gpus < 1 else float(int(r.gpus))
        return Job(job, int(cpu * 1000) if cpu is not None else DEFAULT_CPU_MILLI, int(mem),
                   gpus=gpus, gpu_mem_bytes=int(gmem) if gpus > 0 else 0, workload=ev.workload,
                   priority=self._priority(job),
                   node_selector=self._selector(job),
                   util=min(100.0, pred.gpu_util.mean) if pred and gpus > 0 else None,
                   pred_gpu_mem_bytes=int(pred.gpu_mem_bytes.mean) if pred and gpus > 0 else None)

    def _priority(self, job: str) -> int:
        a = self.admission.get(job)
        return int(a["priority"]) if a and a.get("priority") is not None else self.events[job].priority

    def _selector(self, job: str) -> tuple[tuple[str, str], ...]:
        sel = {str(k): str(v) for k, v in self.events[job].spec.node_selector.items()}
        a = self.admission.get(job) if self.after_admission else None
        if a is not None:
            sel[HOST_LABEL] = a["host"]  # the host the priority agent admitted it on, only
        return tuple(sorted(sel.items()))

    def _rank(self, job: str) -> tuple:
        """Decision order: higher priority first, then submission time, then id."""
        return (-self._priority(job), self.events[job].ts, job)

    def due(self, now: float) -> list[str]:
        """Jobs to decide now (after admission: admitted ones), in :meth:`_rank` order: those whose wait is
        over, those to try again, and the waiting jobs whose need fits a node that gained room since the
        last decisions (the others would not fit anywhere)."""
        return self._round(now)[0]

    def _round(self, now: float) -> tuple[list[str], set[str], np.ndarray]:
        """:meth:`due`, the jobs of it that wait for the room that came (no other reason to try them), and
        the rows of the nodes that gained room."""
        ready = {j for j, t in self.deadline.items() if t <= now} | self.retry
        rows = np.array(sorted(self.cluster.index[n] for n in self.gained if n in self.cluster.index), np.intp)
        room = set(self.queue.could_fit(self.cluster, rows)) - ready if len(rows) else set()
        jobs = sorted((j for j in ready | room if j in self.events and self.may_decide(j)), key=self._rank)
        return jobs, room, rows

    def decide(self, now: float, ts: float) -> list[tuple[Decision, Placement]]:
        out = []
        jobs, room, rows = self._round(now)
        self.gained.clear()
        self.retry.clear()
        missed: dict[tuple, str] = {}  # needs no node took in this round -> why (bookings only take room)
        for job in jobs:
            if job not in self.events:  # refused in this round (place_max_waiting_jobs)
                continue
            self.deadline.pop(job, None)
            j = self._job(job)
            need = need_of(j, self.config.cluster)
            reason = missed.get(need)
            p = None
            if reason is None and job in room and not self.cluster.feasible(j, rows).any():
                # room came where it does not fit (anymore: this round's bookings took it), and nothing grew
                # elsewhere: it still fits nowhere, known without asking the policy (the costly part)
                reason = missed[need] = why_not(j, self.cluster)
            elif reason is None:
                p = self.policy.place(j, self.cluster)
                if p.node is None:
                    reason = missed[need] = p.reason
            if reason is not None:
                why = reason
                if self.after_admission:
                    why = (f"no room on {self.admission[job]['host']}, where the priority agent admitted it "
                           f"(it is placed there only): {reason}")
                self._wait(job, j, why, ts)
                continue
            assert p is not None
            self.cluster.allocate(j, p)
            self.waiting.pop(job, None)
            self.queue.remove(job)
            self.why.pop(job, None)
            self.placed[job] = {"node": p.node, "gpus": list(p.gpus), "ts": ts}
            if self.start_timeout_s > 0:
                self.placed[job]["start_by"] = self.start_by[job] = ts + self.start_timeout_s
            self.put(job, self._record(job))
            out.append((self._decision(j, p, ts), p))
        return out

    def _wait(self, job: str, j: Job, why: str, ts: float) -> None:
        """*job* (needing what *j* needs) waits for room, unless ``place_max_waiting_jobs`` wait already: then
        the job of lowest rank among them and it is refused (:attr:`refused`) and forgotten."""
        cap = self.max_waiting
        if cap and job not in self.queue and len(self.queue) >= cap:
            worst = self.queue.worst()
            assert worst is not None
            rank = self._rank(job)
            if rank > worst[0]:
                self._refuse(job, f"no node takes job {job} now ({why}) and {len(self.queue)} jobs wait for room "
                                  f"already (place_max_waiting_jobs {cap}), each of higher priority or submitted "
                                  f"earlier: refused, not kept; submit it again later")
                return
            self._refuse(worst[1], f"job {worst[1]} no longer waits for room: {len(self.queue)} jobs wait "
                                   f"(place_max_waiting_jobs {cap}) and job {job}, of higher priority or submitted "
                                   f"earlier, came; refused, not kept; submit it again later")
        if self.why.get(job) != why:
            log.info("job %s waits: %s", job, why)
            self.waits.append((job, why, ts))
        self.waiting[job] = self.events[job].ts
        self.why[job] = why
        self.queue.add(job, j, self._rank(job))

    def _refuse(self, job: str, why: str) -> None:
        log.warning("%s", why)
        self.refused.append((self.events[job], why))
        for d in (self.events, self.predictions, self.deadline, self.waiting, self.pending_bookings,
                  self.admission, self.why):
            d.pop(job, None)
        self.queue.remove(job)
        self.retry.discard(job)
        self.put(job, None)

    def take_waits(self) -> list[JobEvent]:
        """The ``waiting`` events of the jobs whose reason to wait changed since the last call (the agent
        publishes them, signed, for ``phasewise jobs`` and subscribers); a job placed or refused since is
        left out."""
        out = [JobEvent(job=job, ts=ts, kind="waiting", reason=why[:MAX_REASON])
               for job, why, ts in self.waits if self.why.get(job) == why]
        self.waits = []
        return out

    def take_refused(self) -> list[tuple[JobEvent, str]]:
        """The jobs refused since the last call (their submitted events and why), for the dead-letter topic."""
        out, self.refused = self.refused, []
        return out

    def start_weight(self, d: Decision) -> Decision | None:
        """The CPU weight decision that follows place decision *d* of an admitted job (after admission,
        with the priority agent's weights on): the priority agent's own rule, which it cannot send itself
        before the job's container exists. ``None`` otherwise."""
        a = self.admission.get(d.details.get("job", d.container)) if self.after_admission else None
        if a is None or self.weight_ratio is None:
            return None
        job = d.details.get("job", d.container)
        w = weight_action(job, d.host, int(a.get("priority") or 0), d.details.get("workload", "training"),
                          self.weight_ratio, "restarted" if a["resume"] else "started")
        return to_decision(w, d.ts, container=d.container)

    def _decision(self, j: Job, p: Placement, ts: float) -> Decision:
        ev = self.events[j.job]
        pred = self.predictions.get(j.job)
        cpuset = self.cluster.labels[self.cluster.index[p.node]].get("cpuset") if self.local else None
        used = {"requests": asdict(ev.spec.requests),
                "prediction": None if pred is None else {
                    "model_version": pred.model_version, "gpu_util": pred.gpu_util.mean,
                    "gpu_mem_bytes": pred.gpu_mem_bytes.mean, "cpu_cores_hi": pred.cpu_cores.hi,
                    "mem_bytes_hi": pred.mem_bytes.hi}}
        why = p.reason + (f"; predicted GPU util {pred.gpu_util.mean:.0f}% (model v{pred.model_version})"
                          if pred else "; no prediction: requests only")
        self.seq += 1
        # what runs is the submitted spec's command, if its signature verifies at the actuator: copied from
        # the submitted event, never written here
        details = {**p.details(), "node": p.node, "cpuset": cpuset, **self.submissions.details(ev),
                   "cpu_milli": j.cpu_milli, "mem_bytes": j.mem_bytes, "gpus": j.gpus, "used": used}
        if j.priority != ev.priority:
            details["admitted_priority"] = j.priority
        container, ident = j.job, [p.node, list(p.gpus)]
        a = self.admission.get(j.job) if self.after_admission else None
        if a is not None:  # when (and whether it resumes) is the priority agent's: its hint says
            details["resume"] = bool(a["resume"])
            details["admitted_host"] = a["host"]
            container = a.get("container") or j.job
            ident += [a["ts"], bool(a["resume"])]  # a restart is a decision of its own
            why = f"admitted on {a['host']}{' (resume)' if a['resume'] else ''} by the priority agent; " + why
        return Decision(id=f"place-{j.job}-{zlib.crc32(json.dumps(ident).encode()):08x}",
                        ts=ts, host=self.host if self.local else p.node, container=container, action="place",
                        policy=p.policy, reason=why, details=details)
