"""One job agent's wiring, written once: a module declares its inputs and timers on a :class:`JobAgent`,
the scaffold runs them on a Faust app.

What every agent shares is here (docs/architecture.md, "Where a new system goes"): the topics (raw bytes,
:func:`~phasewise.streams.topics.raw_topic`), its state in a changelogged table
(:class:`~phasewise.streams.output.JobStateTable`: held writes at each commit, restored from the table on
first use and after a rebalance, forgotten on revocation), the output producer and the commit barrier
(:mod:`phasewise.streams.output`: nothing committed before it is delivered), dead letters and the
event-time gate (:mod:`phasewise.streams.job_inputs`), the cluster key's signatures, readiness, and the
handler that stops the worker when an agent dies (:func:`fail_worker_on_agent_error`). A handler gets the
:class:`Context` and the Faust event; a record it cannot take is a dead letter, never a crash.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from phasewise.kit.command import exit_now
from phasewise.kit.kafka.client import dead_letter as make_dead_letter
from phasewise.kit.records import Decision, JobEvent, SchemaError, encode
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring, keyring_of
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS, Topic
from phasewise.models.jobs.events import Refused
from phasewise.streams.config import job_partitions
from phasewise.streams.job_inputs import DeadLetter, dead_letterer, event_time_gate, refused_output
from phasewise.streams.output import (
    CommitBarrier,
    JobStateTable,
    OutputSender,
    attach,
    changelog_producer,
    output_producer,
)
from phasewise.streams.topics import raw_topic

__all__ = ["Context", "JobAgent", "SetupError", "fail_worker_on_agent_error", "step_outcome", "worker_outputs"]

log = logging.getLogger(__name__)

Handler = Callable[["Context", Any], Awaitable[None]]
Timer = Callable[["Context"], Awaitable[None]]
#: ``keyring=`` unset: the agent reads ``signing_key_file`` itself
_OWN_KEYRING: Any = object()


class SetupError(RuntimeError):
    """An agent cannot run on this cluster as it is (a topic it needs is missing or unusable): one line."""


#: seconds a worker whose agent died may take to stop before it exits anyway: Faust's stop waits for its streams
#: to drain ("Wait for streams..."), and the dead agent's never does; nothing is committed after the death
DEAD_AGENT_EXIT_S = 15.0


def exit_after(delay_s: float, reason: str) -> threading.Thread:
    """A daemon thread that ends this process with status 1 after *delay_s* unless it ended by then."""

    def run() -> None:
        time.sleep(delay_s)
        exit_now(log, logging.CRITICAL, "%s; still stopping %g s later (Faust waits for the dead agent's stream): "
                 "exiting now", reason, delay_s)

    t = threading.Thread(target=run, name="phasewise-dead-agent-exit", daemon=True)
    t.start()
    return t


def fail_worker_on_agent_error(barrier: CommitBarrier, metrics: Any,
                               exit_later: Callable[[float, str], object] = exit_after) -> Callable[..., Any]:
    """``on_error`` of every agent of a worker (the app's ``_on_agent_error``): a dead agent stops the
    worker, and nothing is committed.

    An agent dies only on something that is not a record (a record it cannot
    decode or process becomes a dead letter). Faust's own handler commits the
    offsets acked so far and restarts the agent; the events of the batch the
    agent held are acked when its stream is closed, processed or not; and the
    worker goes on reporting ready. So, before anything else can run:
    the commit barrier refuses every later commit (the batch and everything
    after it are read again by the next worker), the ready gauge
    drops to 0, and the agent's supervisor (``mode.CrashingSupervisor``, see
    :func:`phasewise.streams.app.create_app`) crashes the app, so the process
    exits with status 1 (after :data:`DEAD_AGENT_EXIT_S` at the latest: *exit_later(seconds, reason)*,
    by default :func:`exit_after`).
    """

    async def on_agent_error(agent: Any, exc: BaseException) -> None:
        reason = f"agent {getattr(agent, 'name', agent)} died: {type(exc).__name__}: {exc}"
        barrier.fail(reason)
        metrics.ready.set(0)
        log.critical("%s; no further offsets are committed and the worker stops (exit status 1)", reason,
                     exc_info=exc)
        exit_later(DEAD_AGENT_EXIT_S, reason)

    return on_agent_error


def worker_outputs(app: Any, settings: Settings, metrics: Any,
                   outputs: OutputSender | None = None) -> tuple[OutputSender, CommitBarrier, DeadLetter]:
    """A worker's output producer (default: one from *settings*), its commit barrier attached to *app*'s
    commits, its dead letters (counted in *metrics*), and the handler that stops it when an agent dies."""
    if outputs is None:
        outputs = OutputSender(output_producer(settings), metrics)
    barrier = CommitBarrier(outputs, metrics, changelog=OutputSender(changelog_producer(settings), metrics))
    attach(app, barrier)
    # Faust hands every agent the app's _on_agent_error, which commits the offsets acked so far
    app._on_agent_error = fail_worker_on_agent_error(barrier, metrics)
    return outputs, barrier, dead_letterer(settings, outputs, metrics)


class Context:
    """One job agent on one app: its state, table, outputs and checks, as its handlers see them."""

    def __init__(self, app: Any, settings: Settings, state: Any, metrics: Any, outputs: OutputSender,
                 barrier: CommitBarrier, dead_letter: DeadLetter, keyring: Keyring | None) -> None:
        self.app, self.settings, self.state, self.metrics = app, settings, state, metrics
        self.outputs, self.barrier, self.dead_letter, self.keyring = outputs, barrier, dead_letter, keyring
        #: ``await refused_time(event, kind, key, ts)``: dead-lettered by the event-time rule (set by the agent)
        self.refused_time: Callable[[Any, str, str, float], Awaitable[bool]] | None = None
        self.table: JobStateTable | None = None
        #: what the agent's module keeps beside its state (set by its state factory)
        self.extras: dict[str, Any] = {}

    @property
    def restored(self) -> bool:
        return self.table is not None and self.table.restored

    def ensure_restored(self) -> None:
        if self.table is not None:
            self.table.ensure_restored()

    def send(self, topic: str, key: bytes, value: bytes, *, signed: bool = False,
             on_refused: Callable[[str], None] | None = None, partition: int | None = None) -> None:
        """*value* to *topic* through the worker's output producer; *signed*: with the cluster key's headers
        (none without a key); *on_refused*: see :meth:`~phasewise.streams.output.OutputSender.send`;
        *partition*: this one (else the job-events topic's rule below, or the producer's)."""
        headers = self.keyring.headers(topic, key, value) if signed and self.keyring is not None else None
        # a job's events in one partition, in order: the one its submitter's and actuator's producers (librdkafka's
        # default, CRC32 of the key) put them in, not this producer's murmur2 (kept for the decisions' hosts)
        if partition is None and topic == JOB_EVENTS.name:
            partition = zlib.crc32(key) % job_partitions(self.settings)
        self.outputs.send(topic, key, value, headers, on_refused=on_refused, partition=partition)

    def send_decision(self, d: Decision, on_refused: Callable[[str], None] | None = None) -> None:
        """A decision, keyed by host, signed."""
        self.send(DECISIONS.name, d.host.encode(), encode(d), signed=True, on_refused=on_refused)

    def refused_output(self, event: Any) -> Callable[[str], None]:
        """The ``on_refused`` handler of the outputs *event* causes: it becomes a dead letter."""
        return refused_output(self.dead_letter, event)

    def capacity_letter(self, topic: Topic, key: bytes, payload: bytes, reason: str) -> None:
        """A record this agent drops for want of room (not the input at hand) to the dead letters, kind
        ``capacity``."""
        self.letter(topic, key, payload, reason, "capacity")

    def letter(self, topic: Topic, key: bytes, payload: bytes | None, reason: str, kind: str) -> None:
        """A record this agent drops on its own (not the input at hand: a job refused for want of room, a
        booking released as lost) to the dead letters, counted by *kind*."""
        k, v, _dl = make_dead_letter(source_topic=topic.name, reason=reason, payload=payload, key=key,
                                     max_bytes=self.settings.kafka.dead_letter_max_bytes)
        self.outputs.send(DEAD_LETTERS.name, k, v)
        self.metrics.dead_letters.labels(kind=kind).inc()

    def lost(self, lost: JobEvent, submitted: JobEvent | None) -> None:
        """A booking released as lost (no ``started`` within ``job_start_timeout_s``): its ``lost`` event on
        the job events, signed with the cluster key, and a dead letter of kind ``lost`` holding its
        submitted event and the reason."""
        key = lost.job.encode()
        self.send(JOB_EVENTS.name, key, encode(lost), signed=True)
        self.letter(JOB_EVENTS, key, encode(submitted) if submitted is not None else None,
                    f"job {lost.job} lost: {lost.reason}", "lost")

    def count_ignored(self, counts: dict[str, int], agent: str | None = None) -> None:
        """Add a step's ignored lifecycle states (``{why: n}``) to the agent's counter (*agent*: its label,
        beside the samples agent)."""
        counter = getattr(self.metrics, "job_states_ignored", None)
        if counter is None:
            return
        for why, n in counts.items():
            (counter.labels(agent=agent, why=why) if agent else counter.labels(why=why)).inc(n)

    async def decoded(self, event: Any, read: Callable[[Any], Any]) -> Any:
        """*read* (``lambda raw: decode(Record, raw)``, or a columnar decoder) of the event's value, or
        ``None`` once it is a dead letter (kind ``schema``, with the decoder's reason)."""
        try:
            return read(event.message.value)
        except SchemaError as e:
            await self.dead_letter(event, str(e), "schema")
            return None

    async def failed(self, event: Any, what: str, e: Exception) -> None:
        """A valid record the agent's step failed on (a bug): logged with *what*, kept as a dead letter (kind
        ``processing``); the agent goes on."""
        log.exception("%s", what)
        await self.dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")

    async def unsigned(self, event: Any, what: str) -> bool:
        """Whether *event* must be signed with the cluster key and is not (then it is dead-lettered)."""
        if self.keyring is None:
            return False
        msg = event.message
        why = self.keyring.verify(msg.topic, msg.key, msg.value, msg.headers)
        if why is None:
            return False
        await self.dead_letter(event, f"{what} refused: {why}", "signature")
        return True

    def verify_job_events(self) -> Callable[[bytes | None, bytes | None, Any], str | None] | None:
        """The cluster key's check of a job-events record ``(key, value, headers) -> why not`` (None: no key)."""
        keyring = self.keyring
        if keyring is None:
            return None
        return lambda key, value, headers: keyring.verify(JOB_EVENTS.name, key, value, headers)


class JobAgent:
    """A job agent as its module declares it (a registry, as kopf's): its state table, its state, the
    handlers of its input topics and its timers; :meth:`register` wires them on a Faust app.

    *state*: ``(context) -> state`` with ``writes()`` and ``restore(items) -> count`` (the table's);
    *event_time*: the kinds of key of the event-time gate (:func:`~phasewise.streams.job_inputs.event_time_gate`;
    empty: none); *restore_on_rebalance*: restore the state when a rebalance completes, not only before
    the first record (a timer then runs on a restored state with no record read); *on_restored*:
    ``(context, count)`` after each restore.
    """

    def __init__(self, role: str, table: str, help: str, *, state: Callable[[Context], Any],
                 event_time: tuple[str, ...] = (), restore_on_rebalance: bool = False,
                 on_restored: Callable[[Context, int], None] | None = None) -> None:
        self.role, self.table, self.help = role, table, help
        self.make_state, self.event_time = state, event_time
        self.restore_on_rebalance, self.on_restored = restore_on_rebalance, on_restored
        self.inputs: list[tuple[Topic, str, Handler]] = []
        self.timers: list[tuple[float, str, Timer]] = []

    def on(self, topic: Topic, name: str) -> Callable[[Handler], Handler]:
        """Decorator: ``async def handler(ctx, event)`` runs for each record of *topic* (agent *name*), after
        the state is restored."""

        def add(fn: Handler) -> Handler:
            self.inputs.append((topic, name, fn))
            return fn

        return add

    def every(self, seconds: float, name: str) -> Callable[[Timer], Timer]:
        """Decorator: ``async def timer(ctx)`` runs every *seconds* once the state is restored."""

        def add(fn: Timer) -> Timer:
            self.timers.append((seconds, name, fn))
            return fn

        return add

    def register(self, app: Any, settings: Settings, *, metrics: Any, outputs: OutputSender | None = None,
                 barrier: CommitBarrier | None = None, dead_letter: DeadLetter | None = None,
                 keyring: Any = _OWN_KEYRING) -> Context:
        """Add the table, the agents and the timers to *app*; returns the :class:`Context`.

        Alone (``phasewise horus``, ``place``): its own output producer (or *outputs*), commit barrier,
        dead letters and readiness (``metrics.ready``). Beside the samples agent (``worker --priorities``,
        ``--targets``): that worker's *outputs*, *barrier*, *dead_letter* and *keyring*.
        """
        alone = barrier is None
        if alone:
            outputs, barrier, dead_letter = worker_outputs(app, settings, metrics, outputs)
        assert outputs is not None and barrier is not None and dead_letter is not None
        if keyring is _OWN_KEYRING:
            keyring = keyring_of(settings)  # signs what it sends, checks what must be signed (None: neither)
        ctx = Context(app, settings, None, metrics, outputs, barrier, dead_letter, keyring)
        ctx.state = self.make_state(ctx)
        on_restored = self.on_restored
        ctx.table = JobStateTable(app, barrier, self.table, partitions=job_partitions(settings), state=ctx.state,
                                  help=self.help,
                                  on_restored=(lambda n: on_restored(ctx, n)) if on_restored else (lambda n: None))
        if self.event_time:
            ctx.refused_time = event_time_gate(settings, self.event_time, dead_letter)
        for topic, name, handler in self.inputs:
            self._agent(ctx, topic, name, handler)
        for seconds, name, timer in self.timers:
            self._timer(ctx, seconds, name, timer)
        if alone or self.restore_on_rebalance:
            @app.on_rebalance_complete.connect
            async def _rebalanced(app: Any, **kwargs: Any) -> None:
                if self.restore_on_rebalance:
                    ctx.ensure_restored()
                if alone:
                    metrics.ready.set(0 if ctx.barrier.failure is not None else 1)
        return ctx

    @staticmethod
    def _agent(ctx: Context, topic: Topic, name: str, handler: Handler) -> None:
        settings = ctx.settings
        channel = raw_topic(ctx.app, topic, settings.kafka.topic_partitions or topic.partitions)

        async def run(stream: Any) -> None:
            async for event in stream.events():
                ctx.ensure_restored()
                await handler(ctx, event)

        run.__qualname__ = run.__name__ = handler.__name__
        ctx.app.agent(channel, name=name)(run)

    @staticmethod
    def _timer(ctx: Context, seconds: float, name: str, timer: Timer) -> None:
        async def tick() -> None:
            if ctx.restored:
                await timer(ctx)

        ctx.app.timer(seconds, name=name)(tick)


async def step_outcome(ctx: Context, event: Any, step: Callable[[Any], Any], failed: str) -> Any:
    """*step(message)*'s outcome for a job event, or ``None`` when the event is a dead letter: kind
    ``schema`` when it does not decode, the refusal's kind (:class:`~phasewise.models.jobs.events.Refused`),
    ``processing`` when the step fails on it (a bug: logged as *failed*, the agent goes on)."""
    try:
        return step(event.message)
    except SchemaError as e:
        await ctx.dead_letter(event, str(e), "schema")
    except Refused as e:
        await ctx.dead_letter(event, str(e), e.kind)
    except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
        await ctx.failed(event, failed, e)
    return None
