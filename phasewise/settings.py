"""One frozen settings object per process, read from ``PHASEWISE_*`` and flags.

The environment is read only here, at the edge (:meth:`Settings.from_env`);
everything else receives a :class:`Settings`. Flags override the environment,
which overrides the defaults. Every process prints its settings at start-up.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["LIMITED_FEATURES", "PHASE_FEATURES", "Settings", "SettingsError"]

#: frame features the live phase detector can use, in the CRBM's column order
#: (:data:`phasewise.models.detector.FEATURES`; a test keeps the two equal)
PHASE_FEATURES = ("cpu", "mem", "gpu", "gpu_mem")
#: the resources the phase policy decides limits for (always features)
LIMITED_FEATURES = ("cpu", "mem")


class SettingsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Settings:
    # --- Kafka
    bootstrap: str = "127.0.0.1:9092"
    #: consumer session timeout; the embedded broker completes a group join
    #: after about half of it, so local runs keep it short
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1500
    #: longest a fetch waits for data; the embedded broker does not answer a
    #: waiting fetch when data arrives, so this bounds end-to-end latency there
    #: (on Kafka it only bounds idle round trips)
    fetch_wait_max_ms: int = 20
    create_topics: bool = True
    topic_partitions: int = 0  # 0 = each topic's documented default
    # --- identity
    host: str = dataclasses.field(default_factory=socket.gethostname)
    # --- producer (host agent)
    interval_s: float = 1.0
    cgroup_root: str = "/sys/fs/cgroup"
    cgroup_prefix: str = "phasewise"
    buffer_max_messages: int = 10_000
    # --- worker
    worker_id: str = "phasewise-worker"
    data_dir: str = "/tmp/phasewise"
    web_port: int = 6066
    policy: str = "vpa"
    recommend_interval_s: float = 5.0
    hysteresis: float = 0.10
    # --- actuator
    backend: str = "cgroup"
    cpu_floor_cores: float = 0.05
    mem_margin_bytes: int = 64 * 2**20
    mem_floor_bytes: int = 64 * 2**20
    metrics_port: int = 0  # 0 = no Prometheus endpoint
    log_level: str = "info"
    #: worker: only these hosts' samples are processed (comma-separated; empty = all)
    worker_hosts: str = ""
    #: worker, vpa policy: "bounds" acts like the VPA updater (a limit changes only when the
    #: one in force lies outside the recommender's [lower, upper] confidence bounds, then to
    #: the target); "hysteresis" follows the target whenever it moves by more than hysteresis
    vpa_update_mode: str = "bounds"
    # --- actuator (appended)
    #: ledger of applied decision ids: keep entries this long (must exceed the
    #: decisions topic's retention) and at most this many
    ledger_max_age_days: float = 30.0
    ledger_max_rows: int = 100_000
    #: temporary backend errors: retries after the first attempt, first backoff (doubles)
    apply_retries: int = 3
    apply_retry_backoff_s: float = 0.2
    # --- producer (host agent), appended
    #: seconds the host agent spends flushing buffered samples at shutdown
    flush_timeout_s: float = 5.0
    #: where the host agent reads /proc/<pid>/cgroup to attribute GPU processes
    proc_root: str = "/proc"
    # --- worker: VPA recommender (appended)
    #: multiplies every VPA duration (24 h half-lives, memory interval, confidence
    #: interval): 1 = Kubernetes VPA; 0.001 = a VPA "day" lasts 86.4 s (demo, tests)
    vpa_time_scale: float = 1.0
    #: floors of every recommendation (VPA: 25 millicores, 250 MiB)
    vpa_min_cpu_cores: float = 0.025
    vpa_min_mem_bytes: int = 250 * 2**20
    #: phasewise's throttling bump: a sample throttled in more than this share of
    #: CFS periods is recorded as limit * (1 + vpa_throttle_bump)
    vpa_throttle_threshold: float = 0.1
    vpa_throttle_bump: float = 0.5
    #: the worker persists a container's state (a changelogged table write, ~300 us)
    #: when it decides, else at most once per this many seconds of event time
    #: (checked at recommendation steps); samples since the last write are lost
    #: if the worker dies
    state_write_interval_s: float = 30.0
    # --- worker: live phase path, --policy phase (appended)
    #: the phase learner publishes a model snapshot this often (when it learned something)
    phase_snapshot_interval_s: float = 30.0
    #: detectors send every this many ready windows (fleet-wide) to the learner
    phase_learn_every: int = 10
    #: windows the CRBM of a cold model learns before phases are assigned
    phase_warmup: int = 256
    #: relative: a phase limit is the container's level (decaying max of its own
    #: usage) x the phase's quantile of usage/level x (1 + margin); absolute: the
    #: phase's pooled usage quantile x (1 + margin) (the design before; worse in replay)
    phase_statistics: str = "relative"
    # --- worker: forgetting containers (appended)
    #: a container with no sample for this long (event time) is dropped from the
    #: worker's memory and tables (VPA garbage-collects after 8 days); 0 = never
    container_ttl_s: float = 691_200.0
    # --- worker: live phase path, learner batches (appended)
    #: detectors hold learn windows until this many are ready and send them as
    #: one batch (also a partial one at every offset commit); the learner makes
    #: one CD step per batch (a step costs ~0.7 ms however small its batch),
    #: steps of 16 windows while the model is cold
    phase_learn_batch: int = 128
    # --- worker: message batches (appended)
    #: the samples agent takes up to this many messages at a time and steps the
    #: containers of distinct hosts together (vectorised: ~half the cost per sample)
    worker_batch_max: int = 16
    #: ... waiting at most this long for them to arrive (adds at most this to latency)
    worker_batch_wait_ms: float = 5.0
    # --- worker: live phase path, frame features (appended)
    #: --policy phase: the CRBM's frame features, a comma list of PHASE_FEATURES
    #: that holds cpu and mem (the limited resources); add gpu,gpu_mem on GPU
    #: hosts (host agents with NVML report them per container; a container
    #: without a GPU has them missing). The shipped pretrained model is
    #: cpu,mem: any other set starts cold and is a different model on the topic
    phase_features: str = "cpu,mem"
    #: --policy phase, no snapshot on the models topic yet: start from the shipped
    #: model pretrained on the AI4DL sample (when phase_features is cpu,mem);
    #: false = start cold (replay sets it so, unless asked: a trace must not be
    #: scored by a model that saw it)
    phase_pretrained: bool = True
    #: --policy phase, relative statistics: a phase's quantile of usage/level is
    #: used up to this, so a limit is at most level x cap x (1 + margin); 0 = no
    #: cap (uncapped, start-up ramps made limits several times the use in replay)
    phase_ratio_cap: float = 1.5
    # --- every consumer: dead letters (appended)
    #: a dead letter (key and value) takes at most this many bytes: a payload
    #: that would not fit is cut and the dead letter says so (``truncated``). It
    #: must fit the broker's message size limit (Kafka's default: 1 MB; the
    #: producers' librdkafka default: 1,000,000 bytes)
    dead_letter_max_bytes: int = 900_000

    @classmethod
    def from_env(cls, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
        """Defaults < ``PHASEWISE_<NAME>`` environment < explicit overrides (flags).

        ``None`` values in *overrides* mean "flag not given".
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"PHASEWISE_{f.name.upper()}")
            if raw is not None:
                values[f.name] = _parse(f.name, f.type, raw)
        for k, v in (overrides or {}).items():
            if v is None:
                continue
            if k not in {f.name for f in fields(cls)}:
                raise SettingsError(f"unknown setting {k!r}")
            values[k] = v
        s = cls(**values)
        s.validate()
        return s

    def validate(self) -> None:
        if not self.bootstrap:
            raise SettingsError("bootstrap address is empty (set --bootstrap or PHASEWISE_BOOTSTRAP)")
        if self.interval_s <= 0:
            raise SettingsError(f"interval_s must be > 0, got {self.interval_s}")
        if not 0 <= self.hysteresis < 1:
            raise SettingsError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.backend not in ("cgroup", "dry-run"):
            raise SettingsError(f"backend must be 'cgroup' or 'dry-run', got {self.backend!r}")
        if self.vpa_update_mode not in ("bounds", "hysteresis"):
            raise SettingsError(f"vpa_update_mode must be 'bounds' or 'hysteresis', got {self.vpa_update_mode!r}")
        if self.cpu_floor_cores <= 0:
            raise SettingsError("cpu_floor_cores must be > 0")
        if not 16_384 <= self.dead_letter_max_bytes <= 1_000_000:
            raise SettingsError(f"dead_letter_max_bytes must be in [16384, 1000000] (the producers' message "
                                f"size limit), got {self.dead_letter_max_bytes}")

    def phase_feature_tuple(self) -> tuple[str, ...]:
        """``phase_features`` parsed, in :data:`PHASE_FEATURES` order; SettingsError if invalid.

        >>> Settings(phase_features="gpu_mem, mem,cpu").phase_feature_tuple()
        ('cpu', 'mem', 'gpu_mem')
        """
        got = [f.strip() for f in self.phase_features.split(",") if f.strip()]
        unknown = sorted(set(got) - set(PHASE_FEATURES))
        if unknown:
            raise SettingsError(f"phase_features: unknown feature(s) {', '.join(unknown)}; "
                                f"choose from {','.join(PHASE_FEATURES)}")
        if len(set(got)) != len(got):
            raise SettingsError(f"phase_features lists a feature twice: {self.phase_features!r}")
        missing = [f for f in LIMITED_FEATURES if f not in got]
        if missing:
            raise SettingsError(f"phase_features must hold {','.join(LIMITED_FEATURES)} (the resources the "
                                f"phase policy limits); {','.join(missing)} missing in {self.phase_features!r}")
        return tuple(f for f in PHASE_FEATURES if f in got)

    def describe(self) -> str:
        return "settings: " + " ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))

    def worker_host_set(self) -> frozenset[str]:
        return frozenset(h.strip() for h in self.worker_hosts.split(",") if h.strip())

    def kafka_common(self) -> dict[str, Any]:
        return {"bootstrap.servers": self.bootstrap}


def _parse(name: str, tp: Any, raw: str) -> Any:
    tp = str(tp)
    try:
        if tp == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if tp == "int":
            return int(raw)
        if tp == "float":
            return float(raw)
        return raw
    except ValueError:
        raise SettingsError(f"PHASEWISE_{name.upper()}={raw!r} is not a valid {tp}") from None


def fields_of(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}
