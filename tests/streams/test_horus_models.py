"""What a job event's model can do to a real ``phasewise horus``: nothing (private broker, real worker).

By default horus builds catalog models only: ``os:abort``, ``this:x`` and the
like are refused by name, nothing imported. With their modules listed in
``horus_model_modules`` they are built in the build server's forked children,
under a time and memory limit: a model that aborts, forks, leaks descriptors,
switches logging off, prints, loops, sleeps, asks for 50 GB, kills the build
server or patches torch gets a dead letter with its reason, and horus stays
alive, alone in its session with its build server, keeps its descriptors and
its log, and goes on predicting the next jobs with unchanged features.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from phasewise.kit.procs import session_pids
from phasewise.kit.records import DeadLetter, JobEvent, JobSpec, SchemaError, UtilisationPrediction, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS, JOB_EVENTS, PREDICTIONS
from phasewise.models.horus.catalog import DATASETS
from phasewise.models.horus.graph_features import features
from tests.streams import hostile_models
from tests.streams.test_horus_worker import Horus
from tests.test_poison import Reader

pytestmark = [pytest.mark.broker, pytest.mark.slow]

HOSTILE = "tests.streams.hostile_models"
#: model -> what its dead letter's reason says (with the modules allowed)
BUILT = {
    "os:abort": "the process building it died of SIGABRT",
    "os:fork": "is not a torch.nn.Module (got int)",
    "os:pipe": "is not a torch.nn.Module (got tuple)",
    "logging:disable": "is not a torch.nn.Module (got NoneType)",
    "this:x": "this has no callable 'x'",
    f"{HOSTILE}:spin": "not built within 4 s (horus_build_timeout_s): stopped",
    f"{HOSTILE}:nap": "not built within 4 s (horus_build_timeout_s): stopped",
    f"{HOSTILE}:hog": "failed to build: MemoryError",
    f"{HOSTILE}:kill_parent": "the build server gave no answer",
}


def submitted(job: str, model: str, dataset: str = "bipedalwalker") -> bytes:
    return encode(JobEvent(job=job, ts=time.time(), kind="submitted",
                           spec=JobSpec(model=model, dataset=dataset, batch_size=8)))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Topics:
    def __init__(self, s: Settings) -> None:
        self.preds = Reader(s, PREDICTIONS.name, PREDICTIONS.partitions)
        self.letters = Reader(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions)

    def predictions(self, tag: str) -> dict[str, UtilisationPrediction]:
        out = {}
        for v in self.preds.drain():
            try:
                p = decode(UtilisationPrediction, v)
            except SchemaError:
                continue
            if p.job.endswith(tag):
                out[p.job] = p
        return out

    def reasons(self, tag: str) -> dict[str, str]:
        out = {}
        for v in self.letters.drain():
            try:
                d = decode(DeadLetter, v)
            except SchemaError:
                continue
            if d.key and d.key.endswith(tag):
                out[d.key] = d.reason
        return out

    def close(self) -> None:
        self.preds.close()
        self.letters.close()


def _wait(pred, timeout_s: float, what: str, h: Horus) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert h.role.alive(), f"{what}: horus died:\n{h.role.log_tail(60)}"
        if pred():
            return
        time.sleep(0.3)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s:\n{h.role.log_tail(60)}")


def _send(s: Settings, records: list[tuple[str, bytes]]) -> None:
    from phasewise.kit.kafka.client import make_producer

    p = make_producer(s, **{"message.max.bytes": 1_048_588})
    for job, v in records:  # one partition: in this order
        p.produce(JOB_EVENTS.name, key=job.encode(), value=v, partition=0)
    assert p.flush(30) == 0


def test_by_default_a_module_function_is_refused_by_name_and_nothing_is_imported(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    tag = uuid.uuid4().hex[:6]
    h = Horus(s, tmp_path, f"pwtest-horus-default-{tag}").start()
    t = Topics(s)
    try:
        models = [*BUILT, f"{HOSTILE}:good"]
        jobs = [(f"h{i}-{tag}", submitted(f"h{i}-{tag}", m)) for i, m in enumerate(models)]
        big = encode(JobEvent(job=f"big-{tag}", ts=time.time(), kind="submitted", spec=JobSpec(
            model="mlp-24x16x4", dataset="vectors", batch_size=8, command=("python", "x" * 1_030_000))))
        _send(s, [*jobs, (f"big-{tag}", big), (f"ok-{tag}", submitted(f"ok-{tag}", "mlp-24x16x4", "vectors"))])
        _wait(lambda: f"ok-{tag}" in t.predictions(tag), 120, "the catalog job's prediction", h)
        _wait(lambda: len(t.reasons(tag)) >= len(jobs) + 1, 60, "every dead letter", h)
        reasons = t.reasons(tag)
        for (job, _), model in zip(jobs, models):
            assert f"module {model.partition(':')[0]} is not in horus_model_modules (empty: catalog models only)" \
                in reasons[job], (model, reasons[job])
        assert "larger than the limit of 65536 bytes" in reasons[f"big-{tag}"]
        assert set(t.predictions(tag)) == {f"ok-{tag}"}
        log = h.role.log_tail(400)
        assert "Beautiful is better than ugly" not in log and "horus_child" not in " ".join(
            open(f"/proc/{pid}/cmdline").read() for pid in session_pids(h.role.pid))  # no build server
        assert h.role.alive()
    finally:
        t.close()
        assert h.role.stop(timeout_s=30) == 0, h.role.log_tail()


def test_allowed_hostile_models_are_dead_letters_and_horus_goes_on_unchanged(broker, tmp_path, monkeypatch):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    tag = uuid.uuid4().hex[:6]
    monkeypatch.setenv("PHASEWISE_HORUS_MODEL_MODULES", f"os, logging, this, {HOSTILE}")
    monkeypatch.setenv("PHASEWISE_HORUS_BUILD_TIMEOUT_S", "4")
    monkeypatch.setenv("PHASEWISE_HORUS_BUILD_MEMORY_BYTES", "1Gi")
    h = Horus(s, tmp_path, f"pwtest-horus-allowed-{tag}").start()
    t = Topics(s)
    try:
        _send(s, [(f"warm-{tag}", submitted(f"warm-{tag}", f"{HOSTILE}:good"))])
        _wait(lambda: f"warm-{tag}" in t.predictions(tag), 120, "the first module:function prediction", h)
        pid = h.role.pid
        fds_before = fds(pid)
        models = [*BUILT, f"{HOSTILE}:change_torch"]
        jobs = [(f"h{i}-{tag}", submitted(f"h{i}-{tag}", m)) for i, m in enumerate(models)]
        after = [(f"good-{tag}", encode(JobEvent(job=f"good-{tag}", ts=time.time(), kind="submitted",
                                                 spec=JobSpec(model=f"{HOSTILE}:good", dataset="bipedalwalker",
                                                              batch_size=16)))),
                 (f"ok-{tag}", submitted(f"ok-{tag}", "mlp-24x16x4", "vectors"))]
        _send(s, [*jobs, *after])
        _wait(lambda: {f"good-{tag}", f"ok-{tag}"} <= set(t.predictions(tag)), 180,
              "predictions for the jobs after the hostile ones", h)
        _wait(lambda: len(t.reasons(tag)) >= len(BUILT), 60, "every hostile model's dead letter", h)
        reasons = t.reasons(tag)
        for (job, _), model in zip(jobs, models):
            if model in BUILT:
                assert BUILT[model] in reasons[job], (model, reasons.get(job))
        # what change_torch did stayed in its child: the next build of good counts its linear layers' FLOPs
        want = features(hostile_models.good, name="g", shape=DATASETS["bipedalwalker"], batch=16, amp=False)
        got = t.predictions(tag)[f"good-{tag}"].features
        assert (got["flops"], got["params"], got["linear"]) == (want.flops, want.params, want.linear)
        # horus: alive, alone in its session with its build server (every builder and what it forked is gone),
        # no descriptor leaked by os:pipe, nothing printed by this:x, still logging after logging:disable
        assert h.role.alive()
        procs = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in session_pids(pid)}
        assert len(procs) == 2 and sum("phasewise.streams.horus_child" in c for c in procs.values()) == 1, procs
        assert fds(pid) <= fds_before + 2, (fds_before, fds(pid))
        log = h.role.log_tail(600)
        assert "Beautiful is better than ugly" not in log
        assert f"dead-lettered {JOB_EVENTS.name}" in log.split("logging:disable")[-1]
    finally:
        t.close()
        assert h.role.stop(timeout_s=30) == 0, h.role.log_tail()
