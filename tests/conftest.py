"""Shared fixtures: an embedded broker per test module, fresh settings per test."""

from __future__ import annotations

import os
import uuid

import pytest

from phasewise.kit.broker import EmbeddedBroker
from phasewise.kit.settings import Settings

# The Faust roles the tests start (they inherit this environment): one whose start stalls (about one start in
# thirty on this suite's busy machine; StartGuard in phasewise.streams.worker) starts afresh sooner than by
# default, within the tests' readiness waits. A test's own environment overrides it.
os.environ.setdefault("PHASEWISE_START_STALL_S", "20")


#: the modules that take half a minute or more of a `make test` run (measured there, longest first): started first,
#: so that none is left running alone at the end of the parallel run (`make test` keeps this order:
#: --no-loadscope-reorder; xdist would otherwise start the modules with the most tests first)
FIRST = (
    "tests/streams/test_exact_recovery.py", "tests/apps/demo/test_demo.py", "tests/streams/test_readiness.py",
    "tests/test_docker.py", "tests/apps/experiment/test_priorities_roles.py",
    "tests/apps/experiment/test_targets_roles.py", "tests/streams/test_horus_worker.py",
    "tests/streams/test_phase_agents.py", "tests/apps/bench/test_fuzz.py", "tests/cli/test_cli_errors.py",
    "tests/streams/test_horus_live.py", "tests/apps/replay/test_kafka.py", "tests/apps/experiment/test_cluster.py",
    "tests/apps/experiment/test_corpus_live.py", "tests/streams/test_horus_models.py", "tests/test_poison.py",
    "tests/streams/test_record_sizes.py", "tests/apps/demo/test_jobs.py", "tests/apps/bench/test_flood_bench.py",
    "tests/apps/experiment/test_corpus.py", "tests/apps/experiment/test_priorities_experiment.py",
    "tests/apps/experiment/test_targets_experiment.py",
)


def _waits(item) -> bool:
    """Whether *item* runs against a broker (its roles mostly wait: group joins, commits, polls)."""
    return item.get_closest_marker("broker") is not None or "broker" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """FIRST in its order; then the other modules, those whose tests use a broker (they mostly wait) spread
    evenly among those that only compute, so that some test keeps the cores busy while others wait."""
    rank = {module: i for i, module in enumerate(FIRST)}
    modules = list(dict.fromkeys(item.nodeid.split("::", 1)[0] for item in items))
    waiting = {item.nodeid.split("::", 1)[0] for item in items if _waits(item)}
    rest = [m for m in modules if m not in rank]
    waits, computes = [m for m in rest if m in waiting], [m for m in rest if m not in waiting]
    # each module's place in [0, 1): the i-th of n in its group at (i + 1/2) / n
    place = {m: (i + 0.5) / len(g) for g in (waits, computes) for i, m in enumerate(g)}

    def key(item) -> tuple[int, float]:
        module = item.nodeid.split("::", 1)[0]
        return (rank[module], 0.0) if module in rank else (len(FIRST), place[module])

    items.sort(key=key)  # stable: a module's tests stay in the order collected


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A real Tansu broker on loopback, shared by one module's tests. Each module has its own (it starts in
    ~50 ms): roles that read a topic from its start (a new worker's samples, the job events) see only their
    module's records, not the tens of thousands other modules left before them."""
    log = tmp_path_factory.mktemp("broker") / "tansu.log"
    with EmbeddedBroker(log_path=log) as b:
        yield b


@pytest.fixture
def settings(broker, tmp_path) -> Settings:
    """Settings pointing at the module's broker, with a private data dir."""
    from phasewise.kit.kafka.client import ensure_topics

    s = Settings.from_env(
        {"bootstrap": broker.bootstrap, "host": f"test-{uuid.uuid4().hex[:6]}", "data_dir": str(tmp_path)},
        env={},
    )
    ensure_topics(s)
    return s


def is_root() -> bool:
    return os.geteuid() == 0


requires_root = pytest.mark.skipif(not is_root(), reason="needs root to create cgroups")


@pytest.fixture
def assert_replay_output():
    """A check that each line of ``phasewise replay --json`` validates against the checked-in
    ``infra/schemas/ReplayOutput.v1.json``."""
    import json
    from pathlib import Path

    jsonschema = pytest.importorskip("jsonschema")
    path = Path(__file__).resolve().parents[1] / "infra" / "schemas" / "ReplayOutput.v1.json"
    validator = jsonschema.Draft202012Validator(json.loads(path.read_text()))

    def check(lines: list[dict]) -> None:
        assert lines
        for line in lines:
            errors = [e.message for e in validator.iter_errors(line)]
            assert not errors, (line.get("type"), errors[:3])

    return check
