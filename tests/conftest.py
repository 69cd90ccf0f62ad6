"""Shared fixtures: one embedded broker per test session, fresh settings per test."""

from __future__ import annotations

import os
import uuid

import pytest

from phasewise.kit.broker import EmbeddedBroker
from phasewise.kit.settings import Settings

#: the files that take longest (minutes: an image build, experiments through every role), begun first so
#: that `make test`'s parallel workers do not end on one of them alone; then the other files with a slow test
LONGEST_FIRST = ("tests/test_docker.py", "tests/apps/experiment/test_priorities_roles.py",
                 "tests/apps/experiment/test_targets_roles.py",
                 "tests/apps/experiment/test_cluster.py", "tests/apps/experiment/test_priorities_experiment.py",
                 "tests/test_record_bounds.py", "tests/apps/demo/test_demo.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    """Order the files longest first (each file's tests stay together and in order: ``--dist loadfile``)."""
    root = config.rootpath

    def rank(path) -> int:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)

    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda it: (rank(it.path), it.path not in slow_files, first[it.path]))


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """A real Tansu broker on loopback, shared by the session's tests."""
    log = tmp_path_factory.mktemp("broker") / "tansu.log"
    with EmbeddedBroker(log_path=log) as b:
        yield b


@pytest.fixture
def settings(broker, tmp_path) -> Settings:
    """Settings pointing at the session broker, with a private data dir."""
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


def private_broker_fixture():
    """A module's own broker: for tests whose roles read shared topics from their start (job events),
    where records other tests left on the session broker would change what they decide."""

    @pytest.fixture(scope="module")
    def broker(tmp_path_factory):
        log = tmp_path_factory.mktemp("broker") / "tansu.log"
        with EmbeddedBroker(log_path=log) as b:
            yield b

    return broker
