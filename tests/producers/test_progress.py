"""The progress reporter: batching, never blocking, drop-oldest, outage buffering, the control channel."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
import uuid

import pytest

from phasewise.kit.broker import EmbeddedBroker, free_port
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.records import DeadLetter, JobControl, JobEvent, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import CONTROL, DEAD_LETTERS, JOB_EVENTS
from phasewise.producers.progress import ChildControl, ControlHandler, ProgressReporter, parse_line, tail


class ListSink:
    """A sink that records batches; while ``down`` it delivers nothing; while ``gate`` is clear each send
    waits for it. ``calls`` counts the sends begun (``wait_calls`` waits for a number of them)."""

    def __init__(self) -> None:
        self.batches: list[list[JobEvent]] = []
        self.down = False
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0
        self._called = threading.Condition()
        self.closed = False

    def send(self, batch):
        with self._called:
            self.calls += 1
            self._called.notify_all()
        self.gate.wait()
        if self.down:
            return [False] * len(batch)
        self.batches.append([decode(JobEvent, v) for _, v in batch])
        return [True] * len(batch)

    def wait_calls(self, n: int, timeout_s: float = 30.0) -> bool:
        with self._called:
            return self._called.wait_for(lambda: self.calls >= n, timeout_s)

    def close(self):
        self.closed = True

    def steps(self):
        return [e.step for b in self.batches for e in b]


def test_reports_are_batched_in_order_and_never_block_a_slow_sink():
    sink = ListSink()
    sink.gate.clear()  # the sink hangs until released: a report() that waited for it would never return
    rep = ProgressReporter("job-a", sink=sink, batch_size=50, flush_s=0.05, control=False)
    reported = threading.Event()

    def job():
        for i in range(1000):
            rep.report(step=i, loss=1.0 / (i + 1))
        reported.set()

    try:
        threading.Thread(target=job, daemon=True).start()
        assert sink.wait_calls(1), "the reporter never sent"
        assert reported.wait(60), "report() blocked behind a sink that does not return"
        assert sink.calls == 1 and not sink.batches  # all 1000 were queued while the one send hung
    finally:
        sink.gate.set()
    assert rep.flush(30.0)
    rep.close()
    assert sink.steps() == list(range(1000))
    assert max(len(b) for b in sink.batches) <= 50 and len(sink.batches) >= 20
    assert rep.dropped == 0 and rep.sent == 1000 and sink.closed
    assert sink.batches[0][0].kind == "progress" and sink.batches[0][0].job == "job-a"


def test_full_queue_drops_the_oldest_and_counts_then_delivers_the_rest_in_order_after_the_outage():
    sink = ListSink()
    sink.down = True
    rep = ProgressReporter("job-a", sink=sink, queue_size=10, batch_size=4, flush_s=0.02, retry_s=0.05,
                           control=False)
    for i in range(25):
        rep.report(step=i, loss=2.0)
    # the second send begun after the last report took its batch after a failed batch taken after the
    # reports was given back: the queue has settled to the 10 newest events, 15 dropped
    assert sink.wait_calls(sink.calls + 2), "no send was tried while down"
    assert rep.failed_sends >= 1 and rep.sent == 0
    assert rep.dropped == 15 and rep.queued == 10
    sink.down = False
    assert rep.flush(30.0)
    rep.close()
    assert sink.steps() == list(range(15, 25))


def test_nan_and_negative_steps_are_not_sent_and_counted():
    sink = ListSink()
    with ProgressReporter("job-a", sink=sink, flush_s=0.02, control=False) as rep:
        rep.report(step=1, loss=float("nan"))
        rep.report(step=-1, loss=1.0)
        rep.report(step=2, loss=1.0, metric=0.5, metric_name="accuracy", epoch=0.1)
    assert rep.rejected == 2
    [[ev]] = sink.batches
    assert (ev.step, ev.loss, ev.metric, ev.metric_name, ev.epoch) == (2, 1.0, 0.5, "accuracy", 0.1)


def test_pytorch_step_post_hook_reports_each_optimiser_step():
    torch = pytest.importorskip("torch")
    sink = ListSink()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    last = {}
    with ProgressReporter("job-t", sink=sink, flush_s=0.02, control=False) as rep:
        opt.register_step_post_hook(rep.hook(loss_fn=lambda: last["loss"], every=2))
        x, y = torch.randn(32, 4), torch.randn(32, 1)
        for _ in range(6):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            last["loss"] = loss.detach()
            opt.step()
    events = [e for b in sink.batches for e in b]
    assert [e.step for e in events] == [2, 4, 6]
    assert events[-1].loss < events[0].loss  # a real, decreasing loss came through


def test_control_handler_runs_each_id_once_and_pause_resume_flags():
    got = []
    h = ControlHandler("job-a", on_pause=got.append)
    pause = JobControl(id="c1", job="job-a", ts=1.0, action="pause")
    assert h.handle(pause) and not h.handle(pause)  # duplicate id
    assert not h.handle(JobControl(id="c2", job="job-b", ts=1.0, action="pause"))  # another job
    assert h.paused and got == [pause]
    h.handle(JobControl(id="c3", job="job-a", ts=2.0, action="resume"))
    assert not h.paused
    h.handle(JobControl(id="c4", job="job-a", ts=3.0, action="pause"))
    h.handle(JobControl(id="c5", job="job-a", ts=4.0, action="checkpoint_exit", grace_s=5))
    assert h.exit_requested.is_set() and not h.paused  # a paused job runs to its checkpoint


def test_sidecar_parses_the_demo_jobs_lines():
    text = ("job=charlstm phase=load mb=120.00 elapsed=0.50\n"
            "job=charlstm phase=train step=1 loss=5.5000 elapsed=1.00\n"
            "job=charlstm phase=eval step=1 eval_loss=5.4 elapsed=1.10\n"
            "job=charlstm phase=train step=2 loss=nan elapsed=1.20\n"
            "job=charlstm phase=train step=3 loss=4.2500 elapsed=1.30\n"
            "garbage line\n")
    sink = ListSink()
    with ProgressReporter("charlstm", sink=sink, flush_s=0.02, control=False) as rep:
        assert tail(io.StringIO(text), rep) == 2
    assert [(e.step, e.loss) for b in sink.batches for e in b] == [(1, 5.5), (3, 4.25)]
    assert rep.rejected == 1
    assert parse_line("job=x phase=train step=2 loss=abc") is None


def test_with_stages_every_phase_line_is_reported_with_its_stage_and_the_last_step():
    text = ("job=charlstm phase=load mb=120.00 elapsed=0.50\n"
            "job=charlstm phase=train step=1 loss=5.5000 elapsed=1.00\n"
            "job=charlstm phase=eval step=1 elapsed=1.05\n"
            "job=charlstm phase=eval step=1 eval_loss=5.4 elapsed=1.10\n"
            "job=charlstm phase=train step=2 loss=nan elapsed=1.20\n"
            "job=charlstm phase=checkpoint mb=130 elapsed=1.25\n"
            "job=charlstm phase=bad/word step=3\n"
            "job=charlstm phase=done step=3 loss=4.2500 elapsed=1.30\n"
            "garbage line\n")
    sink = ListSink()
    with ProgressReporter("charlstm", sink=sink, flush_s=0.02, control=False) as rep:
        assert tail(io.StringIO(text), rep, stages=True) == 6
    got = [(e.stage, e.step, e.loss) for b in sink.batches for e in b]
    # an eval line's own figures and the done line's loss are not training losses; a line without a step
    # carries the last one; a NaN loss and a stage that is no word are rejected and counted
    assert got == [("load", 0, None), ("train", 1, 5.5), ("eval", 1, None), ("eval", 1, None),
                   ("checkpoint", 1, None), ("done", 3, None)]
    assert rep.rejected == 2
    with ProgressReporter("charlstm", sink=(plain := ListSink()), flush_s=0.02, control=False) as rep:
        assert tail(io.StringIO(text), rep) == 1  # without --stages: the train lines only, no stage
    assert [(e.stage, e.step) for b in plain.batches for e in b] == [(None, 1)]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, want: tuple[str, ...], timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := _state(pid)) not in want and time.monotonic() < deadline:
        time.sleep(0.02)
    return state


def test_child_control_pauses_resumes_and_terminates_a_real_process():
    code = ("import signal,sys,time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
            "print('ready', flush=True)\nwhile True: time.sleep(0.01)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"  # its SIGTERM handler is in place
        cc = ChildControl(proc, default_grace_s=5)
        cc.pause(JobControl(id="p", job="j", ts=1, action="pause"))
        assert _wait_state(proc.pid, ("T",)) == "T"  # the child stops once it next runs
        cc.resume(JobControl(id="r", job="j", ts=1, action="resume"))
        assert _wait_state(proc.pid, ("S", "R")) in ("S", "R")
        cc.checkpoint_exit(JobControl(id="x", job="j", ts=1, action="checkpoint_exit", grace_s=5))
        assert proc.wait(5) == 3  # the job's own SIGTERM handler ran (graceful)
        cc.cancel()
    finally:
        proc.kill()


def test_child_control_hard_stops_after_the_grace_period():
    code = ("import signal,time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
            "while True: time.sleep(0.01)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"  # it ignores SIGTERM now
        t0 = time.monotonic()
        ChildControl(proc).checkpoint_exit(JobControl(id="x", job="j", ts=1, action="checkpoint_exit", grace_s=0.5))
        assert proc.wait(5) == -9
        assert time.monotonic() - t0 >= 0.45
    finally:
        proc.kill()


# --------------------------------------------------------------------------- through the real broker


def _consume(settings, topic, key: bytes, want: int, timeout_s: float = 30.0):
    c = make_consumer(settings, f"t-{uuid.uuid4().hex[:8]}")
    c.subscribe([topic])
    out, deadline = [], time.monotonic() + timeout_s
    try:
        while len(out) < want and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error() and m.key() == key:
                out.append(m.value())
    finally:
        c.close()
    return out


@pytest.mark.broker
@pytest.mark.slow
def test_reports_buffer_while_no_broker_answers_and_arrive_in_order_when_it_starts():
    port = free_port()
    s = Settings.from_env({"bootstrap": f"127.0.0.1:{port}"}, env={})
    job = f"job-{uuid.uuid4().hex[:6]}"
    rep = ProgressReporter(job, settings=s, control=False, flush_s=0.05, retry_s=0.2, send_timeout_s=1.0)
    try:
        for i in range(30):
            rep.report(step=i, loss=1.0)
        deadline = time.monotonic() + 60
        while rep.failed_sends < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rep.sent == 0 and rep.queued == 30 and rep.failed_sends >= 1
        with EmbeddedBroker(port=port):
            ensure_topics(s, [JOB_EVENTS])
            for i in range(30, 40):
                rep.report(step=i, loss=0.5)
            assert rep.flush(30.0), f"not delivered after the broker started: {rep.queued} queued"
            got = [decode(JobEvent, v) for v in _consume(s, JOB_EVENTS.name, job.encode(), 40)]
            rep.close()
    finally:
        rep.close(1.0)
    steps = [e.step for e in got]
    assert steps[:40] == list(range(40)) and rep.dropped == 0


@pytest.mark.broker
def test_control_channel_through_kafka_delivers_once_and_dead_letters_bad_records(settings):
    job = f"job-{uuid.uuid4().hex[:6]}"
    calls: list[str] = []
    done = threading.Event()

    def on_exit(c):
        calls.append(c.action)
        done.set()

    rep = ProgressReporter(job, settings=settings, on_pause=lambda c: calls.append(c.action),
                           on_resume=lambda c: calls.append(c.action), on_checkpoint_exit=on_exit)
    try:
        assert rep._listener is not None and rep._listener.assigned.wait(30)
        p = make_producer(settings)
        k = job.encode()
        good = [JobControl(id="a", job=job, ts=1.0, action="pause"),
                JobControl(id="a", job=job, ts=1.0, action="pause"),  # duplicate id: once
                JobControl(id="b", job=job, ts=2.0, action="resume"),
                JobControl(id="c", job=job, ts=3.0, action="checkpoint_exit", grace_s=10)]
        bad = [None, b"[" * 100_000 + b"]" * 100_000, bytes(range(256)) * 2400, b'{"v":1,"id":5}']
        old = JobControl(id="old", job=job, ts=1.0, action="checkpoint_exit")  # for an earlier job of this id
        p.produce(CONTROL.name, key=k, value=encode(old), timestamp=int((time.time() - 3600) * 1000))
        p.produce(CONTROL.name, key=k, value=encode(good[0]))
        for b in bad:
            p.produce(CONTROL.name, key=k, value=b)
        for g in good[1:]:
            p.produce(CONTROL.name, key=k, value=encode(g))
        p.produce(CONTROL.name, key=b"other-job", value=encode(JobControl(id="z", job="other-job", ts=1.0,
                                                                          action="pause")))
        p.flush(10)
        assert done.wait(30), calls
        assert calls == ["pause", "resume", "checkpoint_exit"]
        assert rep.exit_requested
        deadline = time.monotonic() + 60
        while rep._listener.dead_letters < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rep._listener.dead_letters == 4
        letters = [decode(DeadLetter, v) for v in _consume(settings, DEAD_LETTERS.name, k, 4)]
        assert {dl.source_topic for dl in letters} == {CONTROL.name} and len(letters) == 4
    finally:
        rep.close()
