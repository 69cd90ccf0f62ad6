"""The stream worker's settings: the worker itself, its VPA, its live phase path.

docs/configuration.md lists them; docs/results.md says what the VPA and phase parameters do in replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.records import WORKLOAD_POLICIES
from phasewise.kit.settings.spec import (
    Group,
    above,
    at_least,
    in_range,
    non_empty,
    parse_float,
    parse_size,
    port,
    setting,
)
from phasewise.models.phases.features import FEATURES, LIMITED, PRETRAINED_MODELS

__all__ = ["PHASE_STATISTICS", "VPA_UPDATE_MODES", "PhaseSettings", "VpaSettings", "WorkerSettings", "feature_tuple"]

VPA_UPDATE_MODES = ("bounds", "hysteresis")
PHASE_STATISTICS = ("relative", "absolute")


def feature_tuple(text: str) -> tuple[str, ...]:
    """A comma list of phase :data:`~phasewise.models.phases.features.FEATURES` holding the LIMITED ones, in order.

    >>> feature_tuple("gpu_mem, mem,cpu")
    ('cpu', 'mem', 'gpu_mem')
    """
    got = [f.strip() for f in text.split(",") if f.strip()]
    unknown = sorted(set(got) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown feature(s) {', '.join(unknown)}; "
                         f"choose from {','.join(FEATURES)}")
    if len(set(got)) != len(got):
        raise ValueError(f"lists a feature twice: {text!r}")
    missing = [f for f in LIMITED if f not in got]
    if missing:
        raise ValueError(f"must hold {','.join(LIMITED)} (the resources the phase policy "
                         f"limits); {','.join(missing)} missing in {text!r}")
    return tuple(f for f in FEATURES if f in got)


def _samples(v: int) -> None:
    if v != 0 and not v >= 2:
        raise ValueError(f"must be 0 (the summary) or >= 2, got {v!r}")


def _windows(text: str) -> tuple[float, ...]:
    """Comma-separated positive seconds, e.g. ``600,3600``."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError("give at least one window, e.g. 600,3600")
    out = tuple(parse_float(p) for p in parts)
    if any(w <= 0 for w in out):
        raise ValueError(f"windows must be positive seconds, got {text!r}")
    return out


def _check_features(v: str) -> None:
    feature_tuple(v)


@dataclass(frozen=True, slots=True)
class WorkerSettings(Group):
    """The stream worker (``phasewise worker``), whatever its policy."""

    id: str = setting("phasewise-worker", check=non_empty, flag="--worker-id", name="worker_id",
                      help="Faust app id = consumer group of all workers")
    web_port: int = setting(0, check=port, flag="--web-port",
                            help="Faust's web server port (its own views and the tables' contents), 0 = none; "
                                 "the worker's /scorecard/ view is on metrics_port")
    policy: str = setting("vpa", choices=WORKLOAD_POLICIES, flag="--policy",
                          help="the policy of workloads that name none (phasewise.io/policy): vpa: VPA "
                               "limits; phase: limits from the shared CRBM phase model with VPA as the fallback")
    #: with --policy vpa, run the phase machinery too (detector, learner, model follower), so workloads
    #: whose phasewise.io/policy is phase are decided with it; without it they are refused (not decided)
    phase_workloads: bool = setting(False, flag="--phase-workloads",
                                    help="with --policy vpa: also run the phase machinery, for workloads whose "
                                         "phasewise.io/policy is phase (without it they are refused, not decided)")
    recommend_interval_s: float = setting(5.0, check=at_least(0), flag="--recommend-interval",
                                          help="seconds of event time between a container's "
                                               "recommendations, 0 = after every sample")
    hysteresis: float = setting(0.10, check=in_range(0, 1, hi_open=True), flag="--hysteresis",
                                help="relative change of a limit needed for a decision")
    #: only these hosts' samples are processed (comma-separated; empty = all)
    hosts: str = setting("", name="worker_hosts",
                         help="process only these hosts' samples (comma-separated; empty = all)")
    #: the worker persists a container's state (a changelogged table write, ~300 us)
    #: when it decides, else at most once per this many seconds of event time
    #: (checked at every sample); samples since the last write are lost if the
    #: worker is killed; 0: every touched container is written at every commit, and a
    #: restarted worker decides exactly as an unkilled one (docs/security.md)
    state_write_interval_s: float = setting(30.0, check=at_least(0),
                                            help="seconds of event time between a container's "
                                                 "table writes (0 = at every commit); the samples since "
                                                 "are read again after a kill (--policy vpa), so recovery "
                                                 "is exact either way")
    #: a container with no sample for this long (event time) is dropped from the
    #: worker's memory and tables (VPA garbage-collects after 8 days); 0 = never
    container_ttl_s: float = setting(691_200.0, check=at_least(0), flag="--container-ttl",
                                     help="seconds of event time without a sample after which a "
                                          "container is forgotten, 0 = never")
    #: the samples agent takes up to this many messages at a time and steps the
    #: containers of distinct hosts together (vectorised: ~half the cost per sample)
    batch_max: int = setting(16, check=at_least(1), name="worker_batch_max",
                             help="messages the samples agent steps together")
    #: ... waiting at most this long for them to arrive (adds at most this to latency)
    batch_wait_ms: float = setting(5.0, check=at_least(0), name="worker_batch_wait_ms",
                                   help="longest wait for such a batch, ms")

    #: a Faust worker (worker, horus, place) that stays not ready this long while its broker answers and its
    #: changelog recovery does not move says why and exits with status 1 (a supervisor restarts it)
    ready_stall_s: float = setting(300.0, check=at_least(0), flag="--ready-stall",
                                   help="seconds a Faust worker (worker, horus, place) may stay not ready while its "
                                        "broker answers and its table recovery makes no progress, before it says "
                                        "why and exits with status 1, 0 = wait forever")

    #: a Faust worker that was never ready and whose consumer has not subscribed to its topics this long (its
    #: broker answering) is stuck in Faust's own start, not waiting for the group: it starts afresh in place
    start_stall_s: float = setting(30.0, check=at_least(0), flag="--start-stall",
                                   help="seconds a Faust worker (worker, horus, place) that was never ready may go "
                                        "without subscribing to its topics while its broker answers, before it "
                                        "starts afresh in its own process (at most 3 starts), 0 = never")

    #: glibc keeps the memory a process frees (the holes numpy's large transient arrays leave in its heap)
    #: instead of giving it back: a Faust worker (worker, horus, place) hands it back every this many seconds
    #: (``malloc_trim``; measured: a third of a flooded worker's resident memory, docs/benchmarks.md)
    heap_trim_interval_s: float = setting(30.0, check=at_least(0),
                                          help="seconds between a Faust worker's returns of freed heap memory to "
                                               "the OS (glibc's malloc_trim; other C libraries: not done), "
                                               "0 = never")

    #: the live scorecard (docs/worker.md): a fixed-size summary per container of time buckets per window
    #: (0 = no scorecard), or the last samples of each container scored exactly, and the windows of event time
    scorecard_buckets: int = setting(5, check=at_least(0), flag="--scorecard-buckets",
                                     help="time buckets per window in the live scorecard's summary of each "
                                          "container (1020 bytes at 5 with two windows), 0 = no scorecard")
    scorecard_samples: int = setting(0, check=_samples,
                                     flag="--scorecard-samples",
                                     help="keep each container's last N samples instead of the summary and score "
                                          "the windows exactly (72 bytes a sample), 0 = the summary")
    scorecard_windows: str = setting("60,300", check=lambda v: _windows(v) and None,
                                     flag="--scorecard-windows",
                                     help="the scorecard's sliding windows, seconds of event time, comma-separated")

    #: known-job priors (docs/priors.md): a run of a workload with a signature (phasewise.io/signature) whose
    #: signature has this many earlier runs starts from their peaks instead of running unlimited until its own
    #: history is min_history_s long; 0 = off
    prior_min_runs: int = setting(3, check=at_least(0), flag="--prior-min-runs",
                                  help="earlier runs of a signature (phasewise.io/signature) a new run's limits may "
                                       "start from before its own history is long enough, 0 = no priors")
    prior_margin: float = setting(0.05, check=in_range(0, 4), flag="--prior-margin",
                                  help="a prior is the highest peak of the earlier runs times 1 + this")
    prior_min_run_s: float = setting(30.0, check=at_least(0), flag="--prior-min-run",
                                     help="seconds of event time a run must have been seen to count as an "
                                          "earlier run")
    prior_profile_interval_s: float = setting(15.0, check=above(0), flag="--prior-profile-interval",
                                              help="seconds of event time between two profiles of a signed run "
                                                   "(phasewise.profiles.v1)")

    def scorecard_windows_s(self) -> tuple[float, ...]:
        """``scorecard_windows`` as seconds."""
        return _windows(self.scorecard_windows)

    def served_policies(self) -> tuple[str, ...]:
        """The limit policies this worker decides with: the VPA always (it is the phase policy's
        fallback), the phase policy with ``--policy phase`` or ``--phase-workloads``."""
        return ("vpa", "phase") if self.policy == "phase" or self.phase_workloads else ("vpa",)

    def host_set(self) -> frozenset[str]:
        """``worker_hosts`` as a set (empty: every host)."""
        return frozenset(h.strip() for h in self.hosts.split(",") if h.strip())


@dataclass(frozen=True, slots=True)
class VpaSettings(Group):
    """The worker's VPA recommender and updater (``--policy vpa``; the phase policy's fallback)."""

    PREFIX: ClassVar[str] = "vpa_"

    #: multiplies every VPA duration (24 h half-lives, memory interval, confidence
    #: interval): 1 = Kubernetes VPA; 0.001 = a VPA "day" lasts 86.4 s (demo, tests)
    time_scale: float = setting(1.0, check=above(0), flag="--vpa-time-scale",
                                help="multiply VPA's 24 h half-lives and intervals by this "
                                     "(1 = Kubernetes VPA; 0.001 = a day in 86.4 s)")
    #: floors of every recommendation (VPA: 25 millicores, 250 MiB)
    min_cpu_cores: float = setting(0.025, check=at_least(0),
                                   help="VPA's minimum CPU recommendation, cores")
    min_mem_bytes: int = setting(250 * 2**20, parse=parse_size, check=at_least(0),
                                 help="VPA's minimum memory recommendation, e.g. 250Mi")
    #: phasewise's throttling bump: a sample throttled in more than this share of
    #: CFS periods is recorded as limit * (1 + vpa_throttle_bump)
    throttle_threshold: float = setting(0.1, check=in_range(0, 1),
                                        help="share of throttled CFS periods above which a CPU "
                                             "sample is censored")
    throttle_bump: float = setting(0.5, check=at_least(0), help="a censored CPU sample counts as "
                                                                 "limit x (1 + bump)")
    #: "bounds" acts like the VPA updater (a limit changes only when the one in
    #: force lies outside the recommender's [lower, upper] confidence bounds, then
    #: to the target); "hysteresis" follows the target whenever it moves by more
    #: than hysteresis
    update_mode: str = setting("bounds", choices=VPA_UPDATE_MODES,
                               help="when a VPA limit changes: outside the confidence bounds, "
                                    "or past the hysteresis")


@dataclass(frozen=True, slots=True)
class PhaseSettings(Group):
    """The worker's live phase path (``--policy phase``): detectors, learner, limits."""

    PREFIX: ClassVar[str] = "phase_"

    #: the phase learner publishes a model snapshot this often (when it learned something)
    snapshot_interval_s: float = setting(30.0, check=above(0), flag="--snapshot-interval",
                                         help="--policy phase: seconds between the learner's model "
                                              "snapshots")
    #: detectors send every this many ready windows (fleet-wide) to the learner
    learn_every: int = setting(10, check=at_least(1), flag="--learn-every",
                               help="--policy phase: detectors send every k-th ready window to "
                                    "the learner")
    #: windows the CRBM of a cold model learns before phases are assigned
    warmup: int = setting(256, check=at_least(0), flag="--phase-warmup",
                          help="--policy phase: windows a cold CRBM learns before phases are "
                               "assigned")
    #: relative: a phase limit is the container's level (decaying max of its own
    #: usage) x the phase's quantile of usage/level x (1 + margin); absolute: the
    #: phase's pooled usage quantile x (1 + margin) (the design before; worse in replay)
    statistics: str = setting("relative", choices=PHASE_STATISTICS, flag="--phase-statistics",
                              help="--policy phase: limits from the container's level x the "
                                   "phase's quantile of usage/level (relative) or the phase's "
                                   "pooled usage quantile (absolute)")
    #: detectors hold learn windows until this many are ready and send them as
    #: one batch (also a partial one at every offset commit); the learner makes
    #: one CD step per batch (a step costs ~0.7 ms however small its batch),
    #: steps of 16 windows while the model is cold
    learn_batch: int = setting(128, check=at_least(1), flag="--learn-batch",
                               help="--policy phase: learn windows go to the learner in batches "
                                    "of this many, one CD step each")
    #: the CRBM's frame features, a comma list of FEATURES that holds cpu
    #: and mem (the limited resources); add gpu,gpu_mem on GPU hosts (host
    #: agents with NVML report them per container; a container without a GPU
    #: has them missing). The shipped pretrained model is cpu,mem: any other
    #: set starts cold and is a different model on the topic
    features: str = setting("cpu,mem", check=_check_features, flag="--phase-features",
                            help="--policy phase: the CRBM's frame features, a comma list of "
                                 "cpu,mem,gpu,gpu_mem holding cpu and mem (add gpu,gpu_mem on "
                                 "GPU hosts)")
    #: no snapshot on the models topic yet: start from the shipped model
    #: pretrained on the AI4DL sample (when features is cpu,mem); false = start
    #: cold (replay sets it so, unless asked: a trace must not be scored by a
    #: model that saw it)
    pretrained: bool = setting(True, help="--policy phase: start from the shipped pretrained model")
    #: which shipped model: corpus (learned on the train split of the shipped corpus of real training
    #: executions at 1 s, as a host agent samples) or ai4dl (the AI4DL IBM DLaaS sample, 10-50 s steps)
    pretrained_model: str = setting("corpus", choices=PRETRAINED_MODELS, flag="--phase-pretrained-model",
                                    help="--policy phase: the shipped model a worker starts from: corpus "
                                         "(real training executions at 1 s) or ai4dl (the AI4DL sample)")
    #: relative statistics: a phase's quantile of usage/level is used up to this,
    #: so a limit is at most level x cap x (1 + margin); 0 = no cap (uncapped,
    #: start-up ramps made limits several times the use in replay)
    ratio_cap: float = setting(1.5, check=at_least(0),
                               help="--policy phase: cap on a phase's quantile of usage/level "
                                    "(0 = no cap)")
    #: a phase limit is the phase's p95 (of usage/level, times the level) x (1 + margin), per resource
    #: (docs/results.md, "Phase margins": 0.05 for CPU was chosen on the corpus's train split over 0.1,
    #: the margin before; memory overruns are OOM kills, its margin was left at 0.1)
    cpu_margin: float = setting(0.05, check=in_range(0, 1),
                                help="--policy phase: CPU phase limits are the phase quantile x (1 + this)")
    mem_margin: float = setting(0.1, check=in_range(0, 1),
                                help="--policy phase: memory phase limits are the phase quantile x (1 + this)")
    #: anticipated transitions (docs/phases.md): a container whose workload has a signature
    #: (phasewise.io/signature) gets the limit of the phase its signature's earlier phase exits say comes
    #: next, this many seconds ahead of it; 0 = off (the default: on the corpus's executions it cost more
    #: slack than it saved overruns, docs/phases.md)
    anticipate_horizon_s: float = setting(0.0, check=in_range(0, 3600), flag="--anticipate-horizon",
                                          help="--policy phase: seconds ahead of a likely phase transition of a "
                                               "signed container its limit is raised to the next phase's, 0 = off")
    anticipate_min_probability: float = setting(0.5, check=in_range(0.01, 1), flag="--anticipate-min-probability",
                                                help="--policy phase: raise ahead only of a transition at least "
                                                     "this likely within the horizon")
    anticipate_min_exits: int = setting(3, check=at_least(1), flag="--anticipate-min-exits",
                                        help="--policy phase: earlier exits of a phase of a signature (that lasted "
                                             "longer than the current one) a prediction needs")
    #: a model snapshot's checkpoint may take this many bytes compressed, and unpack to at most this
    #: many (checked before inflating, and by a bounded inflater: a small bomb never grows in memory)
    snapshot_max_bytes: int = setting(4 * 2**20, parse=parse_size, check=at_least(1024),
                                      help="--policy phase: largest model snapshot, compressed, e.g. 4Mi")
    snapshot_max_unpacked_bytes: int = setting(64 * 2**20, parse=parse_size, check=at_least(1024),
                                               help="--policy phase: largest model snapshot, unpacked")
    #: a snapshot whose version is more than this past the one in use is refused (a forged huge
    #: version would make every later genuine snapshot look old)
    snapshot_max_version_step: int = setting(1000, check=at_least(1),
                                             help="--policy phase: refuse a snapshot more than this many "
                                                  "versions past the one in use")

    @staticmethod
    def cap(ratio_cap: float) -> float | None:
        """A ``phase_ratio_cap`` value as the models take it: 0 means no cap (``None``).

        >>> PhaseSettings.cap(1.5), PhaseSettings.cap(0)
        (1.5, None)
        """
        return ratio_cap or None

    def feature_tuple(self) -> tuple[str, ...]:
        """``phase_features`` parsed, in the order of :data:`~phasewise.models.phases.features.FEATURES`.

        >>> PhaseSettings(features="gpu_mem, mem,cpu").feature_tuple()
        ('cpu', 'mem', 'gpu_mem')
        """
        return feature_tuple(self.features)
