"""The models-topic follower: each worker's view of the newest shared phase model, read to the end at
start-up and followed on a daemon thread that decodes new snapshots off the event loop; a record that
is no usable snapshot goes to *on_bad* (a dead letter). Narrative: docs/worker.md, "The phase path".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from phasewise.kit.records import ModelSnapshot, SchemaError, brief, decode
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import MODELS
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.snapshots import model_name, model_of
from phasewise.streams.following import Following

__all__ = ["SnapshotFollower"]

log = logging.getLogger(__name__)

#: the largest snapshot version taken (integers above are not exact in every JSON reader)
MAX_VERSION = 2**53
#: how many of the newest valid snapshots are kept (a restarted worker starts on the one in force at its last
#: commit: docs/worker.md, "Exact recovery across model snapshots"); a few KB to a few hundred KB each
RECENT = 16


class SnapshotFollower(Following):
    """The newest ``ModelSnapshot`` of one model name, read from the compacted models topic.

    :meth:`load_latest` reads the topic to its end (blocking, at start-up);
    :meth:`start` keeps following it on a daemon thread. :meth:`latest` is
    safe to call from the event loop. A record of this model (its key, or no
    key and its name) that cannot be decoded or loaded as a model (null value,
    malformed JSON, a payload that is no PhaseModel checkpoint, or larger than
    ``phase_snapshot_max_bytes`` packed or ``phase_snapshot_max_unpacked_bytes``
    unpacked, a version more than ``phase_snapshot_max_version_step`` past the
    one in use, and, with a *keyring*, a record unsigned or wrongly signed) goes
    to *on_bad* (value, key, offset, reason), whatever its version; each newer
    valid snapshot to *on_loaded*.
    """

    def __init__(self, settings: Settings, name: str,
                 on_bad: Callable[[bytes | None, bytes | None, int, str], None] | None = None,
                 on_loaded: Callable[[ModelSnapshot], None] | None = None,
                 keyring: Keyring | None = None) -> None:
        self.settings = settings
        self.keyring = keyring
        self.name = name
        self.on_bad = on_bad
        self.on_loaded = on_loaded
        self._lock = threading.Lock()
        self._latest: tuple[ModelSnapshot, PhaseModel] | None = None
        self._recent: dict[int, tuple[ModelSnapshot, PhaseModel]] = {}  # the RECENT newest valid versions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Any = None

    def _make_consumer(self) -> Any:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        from phasewise.kit.kafka.client import make_consumer

        c = make_consumer(self.settings, f"{self.settings.worker.id}-models-follower",
                          **{"fetch.wait.max.ms": 200})
        c.assign([TopicPartition(MODELS.name, 0, OFFSET_BEGINNING)])
        return c

    def _handle(self, msg: Any) -> None:
        if msg is None or msg.error():
            return
        key = msg.key()
        if key is not None and key.decode(errors="replace") != self.name:
            return  # another model's snapshots share the topic
        current = self._latest
        phase = self.settings.phase
        try:
            if self.keyring is not None:
                refused = self.keyring.verify(MODELS.name, key, msg.value(), msg.headers())
                if refused is not None:
                    raise SchemaError(f"ModelSnapshot refused: {refused}")
            snap = decode(ModelSnapshot, msg.value())
            if snap.name != self.name:
                if key is None:
                    return  # another model's snapshot, without a key
                raise SchemaError(f"ModelSnapshot: name {brief(snap.name)} under the key of {self.name!r}")
            if snap.version > MAX_VERSION:
                raise SchemaError(f"ModelSnapshot {self.name} v{snap.version}: version above {MAX_VERSION}")
            if current is not None and snap.version > current[0].version + phase.snapshot_max_version_step:
                raise SchemaError(f"ModelSnapshot {self.name} v{snap.version}: more than "
                                  f"phase_snapshot_max_version_step ({phase.snapshot_max_version_step}) past "
                                  f"v{current[0].version} in use; a forged version would make every later "
                                  f"snapshot look old")
            # every snapshot of this name is checked, old ones too, within the size limits
            model = model_of(snap, max_bytes=phase.snapshot_max_bytes,
                             max_unpacked_bytes=phase.snapshot_max_unpacked_bytes)
            if model_name(model.features) != self.name:
                raise SchemaError(f"ModelSnapshot {self.name} v{snap.version}: the payload is a model of "
                                  f"{model_name(model.features)!r}")
        except Exception as e:  # noqa: BLE001 - decode and model_of raise SchemaError only; a record never stops this
            reason = str(e) if isinstance(e, SchemaError) else f"could not decode: {type(e).__name__}: {e}"
            log.warning("models topic offset %s: %s", msg.offset(), reason)
            if self.on_bad is not None:
                self.on_bad(msg.value(), key, msg.offset(), reason)
            return
        with self._lock:  # kept for a restarted worker pinned to the version in force at its last commit
            self._recent[snap.version] = (snap, model)
            while len(self._recent) > RECENT:
                del self._recent[min(self._recent)]
        if current is not None and snap.version <= current[0].version:
            return
        with self._lock:
            self._latest = (snap, model)
        if self.on_loaded is not None:
            self.on_loaded(snap)
        log.info("model snapshot %s v%d available (%d windows learned)", snap.name, snap.version, snap.samples_seen)

    def load_latest(self, timeout_s: float = 10.0) -> ModelSnapshot | None:
        """Read the models topic to its current end; returns the newest snapshot of this name."""
        from confluent_kafka import TopicPartition

        if self._consumer is None:
            self._consumer = self._make_consumer()
        c = self._consumer
        lo, hi = c.get_watermark_offsets(TopicPartition(MODELS.name, 0), timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        pos = lo - 1
        while pos < hi - 1 and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error():
                pos = m.offset()
                self._handle(m)
        latest = self._latest
        return None if latest is None else latest[0]

    def start(self) -> None:
        if self._consumer is None:
            self._consumer = self._make_consumer()
        self._thread = threading.Thread(target=self._run, name="phasewise-models-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._follow("models follower")

    def latest(self) -> tuple[ModelSnapshot, PhaseModel] | None:
        with self._lock:
            return self._latest

    def version(self, version: int) -> tuple[ModelSnapshot, PhaseModel] | None:
        """Snapshot *version* of this model and its model, if it is among the :data:`RECENT` newest read."""
        with self._lock:
            return self._recent.get(version)

    def versions(self) -> list[int]:
        """The versions :meth:`version` can give."""
        with self._lock:
            return sorted(self._recent)
