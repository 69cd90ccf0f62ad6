"""The progress reporter: a training job's steps and losses to Kafka, and the control channel back.

In the training loop (:class:`ProgressReporter`: ``report`` never blocks,
a bounded queue sent in batches; control records delivered once to
callbacks) or as a sidecar (``phasewise progress -- COMMAND``: the job's
progress lines in, SIGTERM / SIGSTOP / SIGCONT out). docs/targets.md, "In a
training loop" and "As a sidecar".
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from phasewise.kit.records import JobControl, JobEvent, SchemaError, decode, encode
from phasewise.kit.records.jobs import STAGE_PATTERN
from phasewise.kit.topics import CONTROL, JOB_EVENTS

__all__ = ["ControlHandler", "KafkaSink", "ProgressReporter", "Sink", "parse_line", "parse_stage_line"]

log = logging.getLogger(__name__)

_STAGE = re.compile(STAGE_PATTERN)


class Sink(Protocol):
    def send(self, batch: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Deliver ``(key, value)`` records; per record, was it delivered."""
        ...

    def close(self) -> None: ...


class KafkaSink:
    """Records to ``phasewise.job-events.v1`` with confluent-kafka; ``send`` waits for the broker's acks."""

    def __init__(self, bootstrap: str, *, topic: str = JOB_EVENTS.name, timeout_s: float = 5.0,
                 settings: Any = None) -> None:
        from phasewise.kit.kafka.client import make_producer
        from phasewise.kit.settings import Settings

        settings = settings or Settings.from_env({"bootstrap": bootstrap}, env={})
        self.topic = topic
        self.timeout_s = timeout_s
        # a record not acknowledged in time fails back to the reporter's queue, which keeps it
        self._producer = make_producer(settings, **{"message.timeout.ms": int(timeout_s * 1000),
                                                    "linger.ms": 20})

    def send(self, batch: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        done = [False] * len(batch)

        def callback(i: int) -> Callable[[Any, Any], None]:
            def cb(err: Any, _msg: Any) -> None:
                done[i] = err is None
            return cb

        for i, (key, value) in enumerate(batch):
            while True:
                try:
                    self._producer.produce(self.topic, key=key, value=value, on_delivery=callback(i))
                    break
                except BufferError:
                    self._producer.poll(0.05)
        self._producer.flush(self.timeout_s + 1.0)
        return done

    def close(self) -> None:
        self._producer.flush(1.0)


# --------------------------------------------------------------------------- control


class ControlHandler:
    """Runs each :class:`JobControl` for one job once, on the job's callbacks or its flags."""

    def __init__(self, job: str, *, on_checkpoint_exit: Callable[[JobControl], Any] | None = None,
                 on_pause: Callable[[JobControl], Any] | None = None,
                 on_resume: Callable[[JobControl], Any] | None = None) -> None:
        self.job = job
        self._callbacks = {"checkpoint_exit": on_checkpoint_exit, "pause": on_pause, "resume": on_resume}
        self._seen: set[str] = set()
        self.received: list[JobControl] = []
        self.exit_requested = threading.Event()
        self.running = threading.Event()  #: set while not paused
        self.running.set()

    @property
    def paused(self) -> bool:
        return not self.running.is_set()

    def handle(self, ctrl: JobControl) -> bool:
        """Deliver *ctrl*; False when it is for another job or already delivered."""
        if ctrl.job != self.job or ctrl.id in self._seen:
            return False
        self._seen.add(ctrl.id)
        self.received.append(ctrl)
        if ctrl.action == "checkpoint_exit":
            self.exit_requested.set()
            self.running.set()  # a paused job must run to checkpoint
        elif ctrl.action == "pause":
            self.running.clear()
        else:
            self.running.set()
        cb = self._callbacks.get(ctrl.action)
        if cb is not None:
            try:
                cb(ctrl)
            except Exception:  # the job's callback failing must not end the control channel
                log.exception("job %s: %s callback failed", self.job, ctrl.action)
        return True


class ControlListener(threading.Thread):
    """Consumes ``phasewise.control.v1`` and hands this job's records to a :class:`ControlHandler`."""

    def __init__(self, handler: ControlHandler, settings: Any, *, group: str | None = None,
                 since: float | None = None) -> None:
        super().__init__(name=f"phasewise-control-{handler.job}", daemon=True)
        #: records the broker timestamped before this (Unix s) are skipped; default: 60 s before now
        self.since = time.time() - 60.0 if since is None else since
        self.handler = handler
        self.settings = settings
        self.group = group or f"phasewise-job-{handler.job}"
        self.stop_event = threading.Event()
        self.assigned = threading.Event()
        self.dead_letters = 0

    def run(self) -> None:
        from phasewise.kit.kafka.client import make_consumer, make_producer, publish_dead_letter

        # one of these runs beside every job: an idle fetch every 500 ms (Kafka's default; a broker that has
        # data answers at once) instead of every kafka_fetch_wait_max_ms is 25x fewer requests per job
        consumer = make_consumer(self.settings, self.group, **{"enable.auto.commit": True, "fetch.wait.max.ms": 500})
        dlq = None
        consumer.subscribe([CONTROL.name], on_assign=lambda c, parts: self.assigned.set())
        try:
            while not self.stop_event.is_set():
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                if msg.error():
                    continue
                key = msg.key()
                if key is not None and key != self.handler.job.encode():
                    continue
                kind, ts_ms = msg.timestamp()
                if kind and ts_ms > 0 and ts_ms / 1000.0 < self.since:
                    continue  # written before this job started (an earlier job with the same id)
                try:
                    ctrl = decode(JobControl, msg.value())
                except SchemaError as e:
                    dlq = dlq or make_producer(self.settings)
                    publish_dead_letter(dlq, source_topic=CONTROL.name, reason=str(e), payload=msg.value(),
                                        key=key, partition=msg.partition(), offset=msg.offset())
                    dlq.poll(0)
                    self.dead_letters += 1
                    continue
                self.handler.handle(ctrl)
        finally:
            consumer.close()
            if dlq is not None:
                dlq.flush(5.0)

    def stop(self) -> None:
        self.stop_event.set()


# --------------------------------------------------------------------------- reporter


@dataclass
class _Item:
    key: bytes
    value: bytes


class ProgressReporter:
    """A job's progress events, queued without blocking and sent in batches by a background thread."""

    def __init__(self, job: str, *, bootstrap: str | None = None, sink: Sink | None = None,
                 queue_size: int = 10_000, batch_size: int = 200, flush_s: float = 0.5,
                 retry_s: float = 1.0, send_timeout_s: float = 5.0, host: str | None = None,
                 container: str | None = None,
                 metric_name: str | None = None, control: bool | None = None, settings: Any = None,
                 on_checkpoint_exit: Callable[[JobControl], Any] | None = None,
                 on_pause: Callable[[JobControl], Any] | None = None,
                 on_resume: Callable[[JobControl], Any] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not job:
            raise ValueError("job must be a non-empty id")
        if queue_size < 1 or batch_size < 1:
            raise ValueError("queue_size and batch_size must be at least 1")
        if sink is None and bootstrap is None and settings is None:
            raise ValueError("give a Kafka bootstrap (or a sink)")
        if settings is None and bootstrap is not None:
            from phasewise.kit.settings import Settings

            settings = Settings.from_env({"bootstrap": bootstrap}, env={})
        self.job, self.host, self.container, self.metric_name = job, host, container, metric_name
        self.sink: Sink = sink if sink is not None else KafkaSink(
            settings.kafka.bootstrap, settings=settings, timeout_s=send_timeout_s)
        self.queue_size, self.batch_size, self.flush_s, self.retry_s = queue_size, batch_size, flush_s, retry_s
        self.clock = clock
        self.control = ControlHandler(job, on_checkpoint_exit=on_checkpoint_exit, on_pause=on_pause,
                                      on_resume=on_resume)
        self.dropped = 0  #: events dropped (oldest first) because the queue was full
        self.sent = 0
        self.failed_sends = 0  #: batches that were not (all) delivered, e.g. during a broker outage
        self.rejected = 0  #: report() calls whose values could not be put in a record (not finite, negative step)
        self._q: deque[_Item] = deque()
        self._inflight = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name=f"phasewise-progress-{job}", daemon=True)
        self._thread.start()
        self._listener: ControlListener | None = None
        if control or (control is None and settings is not None):
            self._listener = ControlListener(self.control, settings)
            self._listener.start()

    # -- the job's side

    def report(self, *, step: int, loss: float | None = None, metric: float | None = None,
               epoch: float | None = None, metric_name: str | None = None, stage: str | None = None) -> None:
        """Queue one progress event; returns at once (drops the oldest event when the queue is full)."""
        def num(v: Any) -> float | None:
            if v is None:
                return None
            v = float(v.item() if hasattr(v, "item") else v)  # a 0-d tensor or numpy scalar
            return v
        try:
            ev = JobEvent(job=self.job, ts=self.clock(), kind="progress", host=self.host, container=self.container,
                          step=int(step), loss=num(loss), metric=num(metric), epoch=num(epoch),
                          metric_name=metric_name or self.metric_name if metric is not None else None,
                          stage=stage)
            value = encode(ev)
        except (ValueError, TypeError):  # NaN / inf loss or a broken value: the targets agent would reject it
            self.rejected += 1
            return
        if (ev.step is not None and ev.step < 0) or (stage is not None and not _STAGE.match(stage)):
            self.rejected += 1  # (a stage that is no word: every consumer would refuse the record)
            return
        with self._lock:
            if len(self._q) >= self.queue_size:
                self._q.popleft()
                self.dropped += 1
            self._q.append(_Item(self.job.encode(), value))
            self._idle.clear()
            if len(self._q) >= self.batch_size:
                self._wake.set()

    def hook(self, loss_fn: Callable[[], Any] | None = None, every: int = 1) -> Callable[..., None]:
        """A function to call after each optimiser step (or to register as a step post-hook).

        It counts steps and reports every *every*-th with ``loss_fn()`` (e.g. the last loss tensor).
        """
        count = [0]

        def step_hook(*_args: Any, **_kw: Any) -> None:
            count[0] += 1
            if count[0] % every == 0:
                self.report(step=count[0], loss=loss_fn() if loss_fn is not None else None)
        return step_hook

    @property
    def paused(self) -> bool:
        return self.control.paused

    @property
    def exit_requested(self) -> bool:
        return self.control.exit_requested.is_set()

    def wait_while_paused(self, timeout_s: float | None = None) -> bool:
        """Block while a ``pause`` holds (until ``resume`` or ``checkpoint_exit``); True when running."""
        return self.control.running.wait(timeout_s)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued event is delivered (True) or *timeout_s* passes (False)."""
        self._wake.set()
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to *timeout_s*), then stop the threads."""
        self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._listener is not None:
            self._listener.stop()
            self._listener.join(timeout_s)
        self.sink.close()

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def queued(self) -> int:
        """Events not yet delivered: waiting in the queue or being sent."""
        return len(self._q) + self._inflight

    # -- the background thread

    def _take(self) -> list[_Item]:
        with self._lock:
            n = min(self.batch_size, len(self._q))
            self._inflight = n
            return [self._q.popleft() for _ in range(n)]

    def _give_back(self, items: list[_Item]) -> None:
        """Failed items go back to the front, in order; the oldest are dropped if the queue overflows."""
        with self._lock:
            room = self.queue_size - len(self._q)
            if len(items) > room:
                drop = len(items) - max(0, room)
                self.dropped += drop
                items = items[drop:]
            self._q.extendleft(reversed(items))
            self._inflight = 0

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            while True:
                batch = self._take()
                if not batch:
                    self._idle.set()
                    break
                try:
                    ok = self.sink.send([(b.key, b.value) for b in batch])
                except Exception as e:  # a sink must not end reporting
                    log.warning("job %s: progress send failed: %s", self.job, e)
                    ok = [False] * len(batch)
                self.sent += sum(ok)
                self._inflight = 0 if all(ok) else self._inflight
                failed = [b for b, good in zip(batch, ok) if not good]
                if failed:
                    self.failed_sends += 1
                    self._give_back(failed)
                    if self._stop.is_set():
                        return
                    self._stop.wait(self.retry_s)
                    break
            if self._stop.is_set() and not self._q:
                return


# --------------------------------------------------------------------------- sidecar


def parse_line(line: str) -> dict[str, Any] | None:
    """A progress line (``job=NAME phase=train step=N loss=X [metric=Y] ...``) as a dict, else None.

    Only ``phase=train`` lines with a step are progress; values that are not numbers make the line
    not progress.

    >>> parse_line("job=charlstm phase=train step=12 loss=2.5000 elapsed=1.20")
    {'job': 'charlstm', 'step': 12, 'loss': 2.5, 'metric': None}
    >>> parse_line("job=charlstm phase=eval step=12 eval_loss=2.6"), parse_line("hello")
    (None, None)
    """
    p = parse_stage_line(line)
    if p is None or p["stage"] != "train" or p["step"] is None:
        return None
    return {"job": p["job"], "step": p["step"], "loss": p["loss"], "metric": p["metric"]}


def parse_stage_line(line: str) -> dict[str, Any] | None:
    """Any ``job=NAME phase=STAGE [step=N] [loss=X] [metric=Y] ...`` line as a dict (``--stages``), else None.

    The loss and metric are kept for ``phase=train`` only (an eval line's own figures are not a training
    loss); a step or number that does not parse makes the line not progress.

    >>> parse_stage_line("job=charlstm phase=eval step=12 eval_loss=2.6")
    {'job': 'charlstm', 'stage': 'eval', 'step': 12, 'loss': None, 'metric': None}
    >>> parse_stage_line("job=charlstm phase=load mb=80.5")["step"], parse_stage_line("hello")
    (None, None)
    """
    kv: dict[str, str] = {}
    for token in line.split():
        k, sep, v = token.partition("=")
        if not sep or not k:
            return None
        kv[k] = v
    if "job" not in kv or not kv.get("phase"):
        return None
    train = kv["phase"] == "train"
    try:
        step = int(kv["step"]) if "step" in kv else None
        loss = float(kv["loss"]) if train and "loss" in kv else None
        metric = float(kv["metric"]) if train and "metric" in kv else None
    except ValueError:
        return None
    return {"job": kv["job"], "stage": kv["phase"], "step": step, "loss": loss, "metric": metric}


def tail(lines: Iterable[str], reporter: ProgressReporter, *, echo: TextIO | None = None,
         stages: bool = False) -> int:
    """Report every progress line of *lines*; returns how many were reported.

    *stages*: every ``phase=`` line is reported with its stage (``JobEvent.stage``), a line without a step
    at the job's last step (0 before any); otherwise only ``phase=train`` lines, without a stage.
    """
    n = 0
    last_step = 0
    for line in lines:
        if echo is not None:
            echo.write(line)
            echo.flush()
        p = parse_stage_line(line) if stages else parse_line(line)
        if p is None:
            continue
        loss, metric = p["loss"], p["metric"]
        if (loss is not None and not math.isfinite(loss)) or (metric is not None and not math.isfinite(metric)):
            reporter.rejected += 1
            continue
        step = p["step"] if p["step"] is not None else last_step
        last_step = max(last_step, step)
        before = reporter.rejected
        reporter.report(step=step, loss=loss, metric=metric, stage=p.get("stage"))
        n += reporter.rejected == before
    return n


class ChildControl:
    """Control records to signals for a child process: checkpoint_exit → SIGTERM (SIGKILL after grace)."""

    def __init__(self, proc: subprocess.Popen, default_grace_s: float = 30.0) -> None:
        self.proc = proc
        self.default_grace_s = default_grace_s
        self._timer: threading.Timer | None = None

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def checkpoint_exit(self, ctrl: JobControl) -> None:
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        grace = ctrl.grace_s if ctrl.grace_s is not None else self.default_grace_s
        self._timer = threading.Timer(grace, self._signal, (signal.SIGKILL,))
        self._timer.daemon = True
        self._timer.start()

    def pause(self, _ctrl: JobControl) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self, _ctrl: JobControl) -> None:
        self._signal(signal.SIGCONT)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.command import add_common

    add_common(p)
    p.add_argument("--job", required=True, help="the job's id (the events' key)")
    p.add_argument("--file", type=Path, help="read progress lines from this file (default: the command's stdout, "
                                             "else stdin)")
    p.add_argument("--stages", action="store_true",
                   help="report every phase= line (load, eval, checkpoint, ...) with its stage, not only the "
                        "phase=train ones (phasewise record keeps each job's stages)")
    p.add_argument("--grace-s", type=float, default=30.0,
                   help="checkpoint_exit: seconds between SIGTERM and SIGKILL when the record names none")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...: start it and read its stdout")


def run(args: argparse.Namespace) -> int:
    from phasewise.kit.command import settings_from_args

    settings = settings_from_args(args)
    command = [c for c in args.command if c != "--"] if args.command else []
    if command and args.file:
        print("phasewise progress: error: give --file or a command, not both", file=sys.stderr)
        return 2
    if not command:
        rep = ProgressReporter(args.job, settings=settings)
        try:
            if args.file:
                with open(args.file, encoding="utf-8", errors="replace") as f:
                    tail(f, rep, stages=args.stages)
            else:
                tail(sys.stdin, rep, stages=args.stages)
        except OSError as e:
            print(f"phasewise progress: error: {e}", file=sys.stderr)
            return 2
        finally:
            rep.close()
        return 0
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1,
                                errors="replace")
    except OSError as e:
        print(f"phasewise progress: error: cannot start {command[0]}: {e}", file=sys.stderr)
        return 2
    child = ChildControl(proc, args.grace_s)
    rep = ProgressReporter(args.job, settings=settings, on_checkpoint_exit=child.checkpoint_exit,
                           on_pause=child.pause, on_resume=child.resume)
    try:
        assert proc.stdout is not None
        tail(proc.stdout, rep, echo=sys.stdout, stages=args.stages)
        rc = proc.wait()
    finally:
        child.cancel()
        rep.close()
    log.info("job %s: exit %s; %d events sent, %d dropped", args.job, rc, rep.sent, rep.dropped)
    return rc
