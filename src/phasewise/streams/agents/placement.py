"""The placement agents: samples, job events and predictions in, ``place`` decisions out.

- **samples** (``phasewise.samples.v1``): each host's capacity and what is in
  use on it (host CPU and memory, per GPU utilisation and memory) become a
  node of the :class:`~phasewise.models.jobs.placement.Cluster`. In local mode
  (``--local-nodes``) the nodes are cpuset slices of this host instead: each
  slice has its CPUs, an equal share of the host's memory and the GPUs named
  for it, whose readings come from this host's samples.
- **job events** (``phasewise.job-events.v1``): a ``submitted`` job waits for
  its prediction (at most ``place_prediction_wait_s``), then is placed by the
  policy; ``finished`` frees what it had booked and retries waiting jobs.
- **predictions** (``phasewise.predictions.v1``): a job's predicted GPU
  utilisation and memory feed the Horus cost; its predicted CPU and memory
  stand in for requests the spec left out.

Waiting jobs are decided in priority order (higher first, then submission).
A job no node can take stays waiting (below) and is tried again when a node
gains room that it could use. A decision is a :class:`~phasewise.kit.records.Decision`
with action ``place``, ``container`` = the job, ``host`` = the node (local
mode: this host, the slice in ``details.node``), the reason from the policy,
and ``details`` = device (GPU indices), cpuset, node, policy, cost, scores,
what the decision used (requests, prediction) and, copied from the
``submitted`` event, the job, its time, workload, priority, spec, spec digest
and submitter signature (:func:`phasewise.kit.job_signing.start_details`): the
actuator starts the spec's command only if a submitter it trusts signed it;
this agent never writes a command. The priority the job was decided at, where
it differs from the submitted one, is ``admitted_priority``.

**Signatures** (``signing_key_file``): the decisions are signed with the
cluster key, and predictions and the priority agent's hints are taken only
when signed with it (horus and the priority agent sign theirs); others are
dead-lettered (kind ``signature``). A ``submitted`` event's ``container`` is
never used (a job's container is its id, or the one its ``admitted`` hint
names). With ``job_trusted_submitters`` set, a submission no trusted
submitter signed is dead-lettered too: it books nothing.

**After admission** (``place_after_admission``, with the priority agent's
``priority_launcher = place``): the priority agent decides when a job runs,
this agent where. A submitted job is held until its ``admitted`` hint, then
placed by the policy on the admitted host's node(s) only (in local mode: the
slices of this host, when it is that host); a job that does not fit there
waits, with the reason, and is never placed elsewhere. The decision carries
``details.resume`` (a restart from its checkpoint: the actuator reuses the
job's container) and names the hint's container; with CPU weights on, the
job's ``weight`` decision follows it (:meth:`PlacementState.start_weight`). A
``stopped`` hint frees what the job booked (it waits for its next
``admitted``) and retries the waiting jobs; one stamped before the job's
admission is a stale repeat and ignored. Other job-event kinds are skipped, never dead-lettered.

**Waiting jobs.** A waiting job is tried again when a node gains room (a
booking freed, a sample of the node, a new node) and only if what it needs fits
that node (:class:`~phasewise.models.jobs.placement.WaitingJobs`), or when what it
needs changed (a prediction, an admission): placing the next job no longer
retries every waiting one. At most ``place_max_waiting_jobs`` wait: beyond,
the job of lowest rank (priority, then submission) is refused, with a dead
letter (kind ``capacity``) naming the setting, and forgotten.

A record that cannot be decoded is a dead letter; so is a ``submitted`` event
without a spec and an ``admitted`` one without a host, and a job whose
``place`` decision the producer or the broker refuses for itself (too large;
the job events' bounds keep that from happening): the job is forgotten and
its submitted event is the dead letter (kind ``output_refused``). State (``place-state``
table, changelogged, written at commits): ``job/<id>`` = the job, its
admission and, once placed, where; on a restart, placed jobs are booked again,
admitted ones wait again and held ones wait for their admission.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from dataclasses import asdict
from typing import Any

import faust
import numpy as np

from phasewise.kit.job_signing import start_details, trusted_submitters
from phasewise.kit.kafka.client import dead_letter as make_dead_letter
from phasewise.kit.records import (
    Decision,
    HostSamples,
    JobEvent,
    SchemaError,
    UtilisationPrediction,
    decode,
    decode_host_samples,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.signing import keyring_of
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS, PREDICTIONS, SAMPLES
from phasewise.models.jobs.placement import (
    Cluster,
    Gpu,
    Job,
    Node,
    Placement,
    PlacementConfig,
    WaitingJobs,
    make_policy,
    need_of,
    why_not,
)
from phasewise.models.jobs.priorities import to_decision, weight_action
from phasewise.streams.job_inputs import Input, dead_letterer, event_time_gate, refused_output
from phasewise.streams.output import CommitBarrier, OutputSender, attach, output_producer
from phasewise.streams.topics import raw_topic

__all__ = ["NotTrusted", "PlacementMetrics", "PlacementState", "parse_local_nodes", "register_placement"]

log = logging.getLogger(__name__)

TABLE_NAME = "place-state"
MAX_PREDICTIONS = 100_000  # predictions held at most (those of jobs not submitted here go first)
DEFAULT_CPU_MILLI = 1000  # a job that requests no CPU and has no prediction yet is booked one core
#: after admission: the node label naming a node's host (a job admitted on a host selects it)
HOST_LABEL = "phasewise/host"


def parse_local_nodes(text: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``s0=0-1@0;s1=2-3`` -> [(name, cpuset, gpu indices)] (the setting's check ran already).

    >>> parse_local_nodes("s0=0-1@0;s1=2,4")
    [('s0', '0-1', (0,)), ('s1', '2,4', ())]
    """
    out = []
    for part in (x.strip() for x in text.split(";")):
        if not part:
            continue
        name, rest = part.split("=", 1)
        cpus, _, gpus = rest.partition("@")
        out.append((name, cpus, tuple(int(g) for g in gpus.split(",")) if gpus else ()))
    return out


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


class PlacementMetrics:
    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Summary

        self.registry = registry = registry or CollectorRegistry()
        self.decisions = Counter("phasewise_place_decisions", "place decisions published", registry=registry)
        self.decide_seconds = Summary("phasewise_place_decide_seconds", "policy time per decision",
                                      registry=registry)
        self.waiting = Gauge("phasewise_place_waiting_jobs", "jobs no node can take yet", registry=registry)
        self.nodes = Gauge("phasewise_place_nodes", "nodes known", registry=registry)
        self.dead_letters = Counter("phasewise_place_dead_letters", "records dead-lettered", ["kind"],
                                    registry=registry)
        self.delivery_errors = Counter("phasewise_place_delivery_errors", "output records not delivered",
                                       ["topic"], registry=registry)
        for t in (DECISIONS, DEAD_LETTERS):  # zeros: a first error is an increase (rate() and increase() see it)
            self.delivery_errors.labels(topic=t.name)
        self.table_writes = Counter("phasewise_place_table_writes", "state table writes", registry=registry)
        self.commit_flush_seconds = Counter("phasewise_place_commit_flush_seconds", "seconds in commit flushes",
                                            registry=registry)
        self.ready = Gauge("phasewise_place_ready", "1 once partitions are assigned and state restored",
                           registry=registry)
        from phasewise.kit.observe import build_info

        self.build_info = build_info(registry, "place")



class PlacementState:
    """Nodes, waiting and placed jobs, predictions; pure of Faust (the agents hold one).

    Time comes in as arguments (``now``: a monotonic clock for the prediction
    wait, ``ts``: event time for the decisions).
    """

    def __init__(self, settings: Settings, partitions: int = 1) -> None:
        p = settings.place
        self.host = settings.host
        self.policy_name = p.policy
        self.config = PlacementConfig(isolate_inference=p.isolate_inference, horus_frag_weight=p.horus_frag_weight)
        self.wait_s = p.prediction_wait_s
        self.max_waiting = p.max_waiting_jobs
        self.local = parse_local_nodes(p.local_nodes)
        self.partitions = partitions
        #: place only what the priority agent admitted, on the host it admitted it on
        self.after_admission = p.after_admission
        #: the priority agent's CPU weight rule (its settings), sent with an admitted job's place decision
        pr = settings.priority
        self.weight_ratio = pr.cpu_weight_ratio if p.after_admission and pr.cpu_weights else None
        #: the job-event kinds acted on (the others are skipped)
        self.acts_on = frozenset({"submitted", "finished"} | ({"admitted", "stopped"} if p.after_admission else set()))
        #: the submitters whose jobs it places (``job_trusted_submitters``; ``None``: every job)
        self.submitters = trusted_submitters(settings.jobs.trusted_submitters)
        self.reset()

    def reset(self) -> None:
        self.cluster = Cluster([], self.config)
        self.policy = make_policy(self.policy_name)
        self.events: dict[str, JobEvent] = {}  # submitted, not finished
        self.predictions: dict[str, UtilisationPrediction] = {}
        self.deadline: dict[str, float] = {}  # job -> monotonic time it is decided without a prediction
        self.waiting: dict[str, float] = {}  # job -> submission ts (decided, no node yet)
        self.placed: dict[str, dict] = {}  # job -> {"node", "gpus"}
        self.pending_bookings: dict[str, dict] = {}  # restored placements whose node is not known yet
        #: after admission: job -> its admitted hint {"host", "resume", "ts", "container"}, until stopped or finished
        self.admission: dict[str, dict] = {}
        self.why: dict[str, str] = {}  # waiting job -> why no node takes it
        self.queue = WaitingJobs(self.config)  # the waiting jobs tried and not placed, by what they need
        self.retry: set[str] = set()  # waiting jobs to try again whatever the nodes (what they need changed)
        self.gained: set[str] = set()  # nodes that may have gained room since the last decisions
        #: jobs refused since the agent last took them: (their submitted event, why)
        self.refused: list[tuple[JobEvent, str]] = []
        self.writes: dict[str, tuple[int, bytes | None]] = {}
        self.seq = 0

    # -- table ---------------------------------------------------------------------------
    def put(self, job: str, value: Any) -> None:
        key = f"job/{job}"
        self.writes[key] = (zlib.crc32(key.encode()) % self.partitions,
                            None if value is None else json.dumps(value, separators=(",", ":")).encode())

    def _record(self, job: str) -> dict:
        return {"event": json.loads(encode(self.events[job])) if job in self.events else None,
                "placed": self.placed.get(job), "admitted": self.admission.get(job),
                "prediction": json.loads(encode(self.predictions[job])) if job in self.predictions else None}

    def restore(self, items: Any) -> None:
        self.reset()
        for k, raw in items:
            if raw is None or not k.startswith("job/"):
                continue
            v = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
            if v.get("admitted"):
                self.admission[k.removeprefix("job/")] = dict(v["admitted"])
            if v.get("event") is None:  # admitted before its submitted event was read
                continue
            ev = decode(JobEvent, json.dumps(v["event"]))
            self.events[ev.job] = ev
            if v.get("prediction"):
                self.predictions[ev.job] = decode(UtilisationPrediction, json.dumps(v["prediction"]))
            if v.get("placed"):
                self.placed[ev.job] = v["placed"]
                self.pending_bookings[ev.job] = v["placed"]
            elif self.after_admission and ev.job not in self.admission:
                self.deadline[ev.job] = 0.0  # held: decided once admitted
            else:
                self.waiting[ev.job] = ev.ts
                self.retry.add(ev.job)  # tried at the next decisions, then indexed
        log.info("restored %d placed, %d waiting and %d held jobs", len(self.placed), len(self.waiting),
                 len(self.deadline))

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
                del self.pending_bookings[job]
        return True

    def submitted(self, ev: JobEvent, now: float) -> None:
        if ev.spec is None:
            raise ValueError("a submitted event needs a spec")
        if self.submitters is not None:
            self.submitters.refresh()
            if (why := self.submitters.verify_event(ev)) is not None:
                raise NotTrusted(f"JobEvent: submitted job {ev.job!r} refused: {why}")
        if ev.job in self.placed:
            return  # already placed (a redelivered event)
        self.events[ev.job] = ev
        # its prediction may have come first (another topic): then no wait
        self.deadline[ev.job] = 0.0 if ev.job in self.predictions else now + self.wait_s
        self.put(ev.job, self._record(ev.job))

    def prediction(self, p: UtilisationPrediction) -> None:
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
        self._freed(self.cluster.release(job))
        for d in (self.events, self.predictions, self.deadline, self.waiting, self.placed, self.pending_bookings,
                  self.admission, self.why):
            d.pop(job, None)
        self.queue.remove(job)
        self.retry.discard(job)
        self.put(job, None)

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
        if self.admission.pop(job, None) is None and was is None:
            return
        if job in self.events:
            self.deadline[job] = 0.0  # (decided once admitted again)
        self.put(job, self._record(job))

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
            need = need_of(j, self.config)
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
                self._wait(job, j, why)
                continue
            assert p is not None
            self.cluster.allocate(j, p)
            self.waiting.pop(job, None)
            self.queue.remove(job)
            self.why.pop(job, None)
            self.placed[job] = {"node": p.node, "gpus": list(p.gpus)}
            self.put(job, self._record(job))
            out.append((self._decision(j, p, ts), p))
        return out

    def _wait(self, job: str, j: Job, why: str) -> None:
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
        details = {**p.details(), "node": p.node, "cpuset": cpuset, **start_details(ev), "cpu_milli": j.cpu_milli,
                   "mem_bytes": j.mem_bytes, "gpus": j.gpus, "used": used}
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


def register_placement(app: faust.App, settings: Settings, *, metrics: PlacementMetrics | None = None,
                       outputs: OutputSender | None = None) -> dict[str, Any]:
    """Add the state table, the three agents and the decision timer to *app*; returns the handles."""
    from phasewise.streams.agents.samples import fail_worker_on_agent_error

    metrics = metrics or PlacementMetrics()
    partitions = settings.kafka.topic_partitions or JOB_EVENTS.partitions
    jobs_topic = raw_topic(app, JOB_EVENTS, partitions)
    preds_topic = raw_topic(app, PREDICTIONS, settings.kafka.topic_partitions or PREDICTIONS.partitions)
    samples_topic = raw_topic(app, SAMPLES, settings.kafka.topic_partitions or SAMPLES.partitions)
    table = app.Table(TABLE_NAME, default=None, partitions=partitions,
                      schema=faust.Schema(key_type=str, key_serializer="json", value_serializer="raw"),
                      help="place: submitted and placed jobs")
    if outputs is None:
        outputs = OutputSender(output_producer(settings), metrics)
    barrier = CommitBarrier(outputs, metrics)
    attach(app, barrier)
    state = PlacementState(settings, partitions)
    writes = barrier.table(table)

    def hold() -> None:
        for k, (p, v) in state.writes.items():
            writes.put(k, v, p)
        state.writes.clear()

    barrier.before.append(hold)
    restored = [False]

    def ensure_restored() -> None:
        if not restored[0]:
            state.restore(list(table.data.items()))
            restored[0] = True

    dead_letter = dead_letterer(settings, outputs, metrics)

    app._on_agent_error = fail_worker_on_agent_error(barrier, metrics)  # type: ignore[method-assign]
    # one stamped far ahead or behind would order a job's wait, or a node's use, by a time that has not come
    refused_time = event_time_gate(settings, ("job", "prediction", "host"), dead_letter)
    keyring = keyring_of(settings)  # signs the decisions, checks predictions and hints (None: neither)

    def send_decision(d: Decision, on_refused: Any = None) -> None:
        key, value = d.host.encode(), encode(d)
        outputs.send(DECISIONS.name, key, value,
                     None if keyring is None else keyring.headers(DECISIONS.name, key, value), on_refused=on_refused)

    async def unsigned(event: Any, what: str) -> bool:
        """Whether *event* must be signed with the cluster key and is not (then it is dead-lettered)."""
        if keyring is None:
            return False
        msg = event.message
        why = keyring.verify(msg.topic, msg.key, msg.value, msg.headers)
        if why is None:
            return False
        await dead_letter(event, f"{what} refused: {why}", "signature")
        return True

    def refused_for(job: str) -> Any:
        """The ``on_refused`` handler of *job*'s place decision: the job is forgotten (what it booked frees,
        it is not decided again) and its submitted event becomes a dead letter."""
        ev = state.events.get(job)
        letter = refused_output(dead_letter, Input(JOB_EVENTS.name, job.encode(), None if ev is None else encode(ev)))

        def refused(why: str) -> None:
            state.finished(job)
            letter(why)

        return refused

    def decide() -> None:
        t0 = time.perf_counter()
        made = state.decide(time.monotonic(), time.time())
        for d, _p in made:
            job = d.details.get("job", d.container)
            send_decision(d, on_refused=refused_for(job))
            if job not in state.placed:
                continue  # refused at once (too large for the producer): no weight follows
            metrics.decisions.inc()
            log.info("placed %s on %s %s: %s", d.container, d.details["node"], d.details["device"], d.reason)
            w = state.start_weight(d)
            if w is not None:  # after the place decision, on the same partition: the container exists by then
                send_decision(w)
                log.info("weight %s: %s", w.container, w.reason)
        if made:
            metrics.decide_seconds.observe((time.perf_counter() - t0) / len(made))
        for ev, why in state.take_refused():  # place_max_waiting_jobs: dropped, told on the dead-letter topic
            key, value, _dl = make_dead_letter(source_topic=JOB_EVENTS.name, reason=why, payload=encode(ev),
                                               key=ev.job.encode(), max_bytes=settings.kafka.dead_letter_max_bytes)
            outputs.send(DEAD_LETTERS.name, key, value)
            metrics.dead_letters.labels(kind="capacity").inc()
        metrics.waiting.set(len(state.waiting))
        metrics.nodes.set(len(state.cluster))
        outputs.poll()

    @app.agent(jobs_topic, name="phasewise.place-jobs")
    async def on_jobs(stream: faust.StreamT) -> None:
        async for event in stream.events():
            ensure_restored()
            try:
                ev = decode(JobEvent, event.message.value)
                if ev.kind not in state.acts_on:
                    continue  # progress, priority; the hints unless after admission: not this agent's concern
                if ev.kind in ("admitted", "stopped") and await unsigned(event, f"JobEvent {ev.kind} {ev.job}"):
                    continue  # the priority agent's hints: with a key, only those it signed
                if await refused_time(event, "job", ev.job, ev.ts):
                    continue
                if ev.kind == "submitted":
                    state.submitted(ev, time.monotonic())
                elif ev.kind == "finished":
                    state.finished(ev.job)
                elif ev.kind == "admitted":
                    state.admitted(ev)
                else:  # stopped
                    state.stopped(ev.job, ev.ts)
            except NotTrusted as e:
                await dead_letter(event, str(e), "signature")
                continue
            except (SchemaError, ValueError) as e:
                await dead_letter(event, str(e), "schema")
                continue
            decide()

    @app.agent(preds_topic, name="phasewise.place-predictions")
    async def on_predictions(stream: faust.StreamT) -> None:
        async for event in stream.events():
            ensure_restored()
            try:
                pred = decode(UtilisationPrediction, event.message.value)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            if await unsigned(event, f"prediction for {pred.job}"):
                continue
            if await refused_time(event, "prediction", pred.job, pred.ts):
                continue
            state.prediction(pred)
            decide()

    @app.agent(samples_topic, name="phasewise.place-samples")
    async def on_samples(stream: faust.StreamT) -> None:
        async for event in stream.events():
            ensure_restored()
            try:
                hs = decode_host_samples(event.message.value)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            if await refused_time(event, "host", hs.host, hs.ts):
                continue
            try:
                changed = state.samples(hs)
            except ValueError as e:
                await dead_letter(event, f"node update refused: {e}", "processing")
                continue
            if changed and state.waiting:
                decide()

    @app.timer(0.25)
    async def _tick() -> None:
        if restored[0] and state.pending(time.monotonic()):
            decide()

    @app.on_partitions_revoked.connect
    async def _forget(app: faust.App, revoked: Any, **kwargs: Any) -> None:
        restored[0] = False

    @app.on_rebalance_complete.connect
    async def _ready(app: faust.App, **kwargs: Any) -> None:
        ensure_restored()
        metrics.ready.set(0 if barrier.failure is not None else 1)

    return {"jobs": on_jobs, "predictions": on_predictions, "samples": on_samples, "table": table,
            "state": state, "metrics": metrics, "outputs": outputs, "barrier": barrier}
