"""The phase agents' side of the model pin, without Kafka: what an assignment reads and counts, the version of
each sample read again, what a commit swaps and records (phasewise.streams.agents.phases.PhaseAgents)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from phasewise.kit.records import ModelSnapshot
from phasewise.kit.settings import Settings
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.pinning import record_key, record_value, recorded_history
from phasewise.models.phases.updater import PhaseHooks
from phasewise.streams.agents.phases import PhaseAgents
from phasewise.streams.config import detector_config, state_cache
from phasewise.streams.metrics import WorkerMetrics

S = Settings.from_env({"policy": "phase"}, env={})


def model(seed: int) -> PhaseModel:
    return PhaseModel(features=("cpu", "mem"), n_hid=4, n_his=1, warmup=8, seed=seed)


def snap(v: int) -> ModelSnapshot:
    return ModelSnapshot(name="phase-crbm/cpu+mem", ts=1.0, version=v, payload_b64="")


class Follower:
    def __init__(self, versions: dict[int, PhaseModel]) -> None:
        self.models = versions

    def versions(self) -> list[int]:
        return sorted(self.models)

    def version(self, v: int):
        return (snap(v), self.models[v]) if v in self.models else None

    def latest(self):
        v = max(self.models)
        return snap(v), self.models[v]


class Writes(dict):
    def put(self, key, value, partition):
        self[key] = (partition, value)

    def get(self, key, default=None):  # what DeferredWrites.get gives: the held value, else the table's
        got = super().get(key)
        return got[1] if isinstance(got, tuple) else got


def agents(versions: dict[int, PhaseModel], start: int, writes: Writes):
    follower = Follower(versions)
    hooks = PhaseHooks(detector_config(S), state_cache(S), model=versions.get(start, model(0)), version=start,
                       latest=follower.latest)
    metrics = WorkerMetrics(CollectorRegistry())
    h = PhaseAgents(hooks, None, follower, None, writes, None, metrics, b"k", initial=lambda: model(0))
    return h, hooks, metrics


def count(metrics: WorkerMetrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("phasewise_worker_model_pins_total", {"outcome": outcome}) or 0.0


def test_a_restart_decides_with_the_recorded_versions_and_a_commit_past_the_fence_swaps_and_records_it():
    writes = Writes({record_key(0): record_value([(0, 1), (9, 2)]), record_key(1): {"model_version": 2}})
    h, hooks, metrics = agents({1: model(1), 2: model(2), 3: model(3)}, 3, writes)
    assert not hooks.swap_on_step  # the worker swaps at its commits only
    h.assigned({0: 10, 1: 5}, {0: 8, 1: 5})
    assert count(metrics, "pinned") == 1
    assert h.version_at(0, 8) == 1 and h.version_at(0, 9) == 2 and h.version_at(1, 5) == 2
    h.use_version(1)  # the samples agent, before a round of those samples
    assert hooks.version == 1 and metrics.registry.get_sample_value("phasewise_worker_model_version") == 1
    h.use_version(2)
    h.at_commit()
    assert hooks.version == 2  # fenced: partition 0 not read to 10 yet
    h.processed(0, 9)
    h.at_commit()
    assert hooks.version == 3
    assert {k: recorded_history(v[1]) for k, v in writes.items() if isinstance(v, tuple)} == \
        {record_key(0): [(0, 1), (9, 2), (10, 3)], record_key(1): [(0, 2), (5, 3)]}
    assert metrics.registry.get_sample_value("phasewise_worker_model_version") == 3


def test_the_starting_model_is_version_0_and_a_version_gone_from_the_topic_is_counted():
    writes = Writes({record_key(0): record_value([(0, 0)])})
    h, hooks, metrics = agents({4: model(4)}, 4, writes)
    h.assigned({0: 3}, {0: 0})
    assert h.version_at(0, 1) == 0 and count(metrics, "pinned") == 1
    h.use_version(0)
    assert hooks.version == 0  # the starting model, rebuilt from the settings
    writes = Writes({record_key(0): record_value([(0, 2)])})
    h, hooks, metrics = agents({4: model(4)}, 4, writes)
    h.assigned({0: 3}, {0: 0})
    assert h.version_at(0, 1) == 4 and count(metrics, "unavailable") == 1 and count(metrics, "pinned") == 0
    h, hooks, metrics = agents({4: model(4)}, 4, Writes())
    h.assigned({0: 3}, {0: None})
    assert hooks.version == 4 and count(metrics, "pinned") == 0  # a first start: no record, nothing counted
    h.at_commit()
    assert recorded_history(h.writes.get(record_key(0))) == [(0, 4)]  # recorded at the first commit
