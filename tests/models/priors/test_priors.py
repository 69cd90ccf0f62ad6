"""Known-job priors: the book of earlier runs, and the worker's step deciding a new run of a known job from it
(the history rule counts the earlier runs; every other rule holds)."""

from __future__ import annotations

import json

import pytest

from phasewise.kit.records import ContainerSample, ExecutionProfile, HostSamples, WorkloadPolicy, decode, encode
from phasewise.kit.settings import Settings
from phasewise.models.priors.book import PriorBook, PriorConfig
from phasewise.models.safety.workload import parse_settings, resolve
from phasewise.models.vpa.updater import process_host_samples
from phasewise.streams.config import state_cache, updater_config

MIB = 2**20


def profile(container: str, cpu: float, mem: float, *, start: float = 0.0, ts: float = 100.0,
            signature: str = "train-lm") -> ExecutionProfile:
    return ExecutionProfile(signature=signature, host="h", container=container, ts=ts, start=start, samples=10,
                            cpu_peak_cores=cpu, mem_peak_bytes=mem)


# ------------------------------------------------------------------ the book


def test_the_prior_is_the_highest_peak_of_the_earlier_runs_plus_the_margin() -> None:
    book = PriorBook(PriorConfig(min_runs=2, margin=0.25, min_run_s=30.0))
    book.learn(profile("a", 1.0, 400 * MIB))
    assert book.prior("train-lm") is None  # one run: too few
    book.learn(profile("b", 2.0, 300 * MIB))
    p = book.prior("train-lm")
    assert (p.runs, p.cpu_cores, p.mem_bytes) == (2, 2.5, 500 * MIB)
    assert p.explain()["limits"] == {"cpu": 2.5, "mem": 500 * MIB}
    assert book.prior("train-lm", exclude="h/b") is None  # a run is never its own prior
    assert book.prior("other") is None


def test_short_runs_and_older_profiles_of_a_run_do_not_count() -> None:
    book = PriorBook(PriorConfig(min_runs=2, margin=0.0, min_run_s=30.0))
    book.learn(profile("a", 1.0, 100.0, start=0.0, ts=100.0))
    book.learn(profile("b", 9.0, 900.0, start=90.0, ts=100.0))  # seen for 10 s only
    assert book.prior("train-lm") is None
    book.learn(profile("b", 3.0, 300.0, start=0.0, ts=120.0))  # the run's newer profile
    book.learn(profile("b", 1.0, 100.0, start=0.0, ts=110.0))  # an older one, read late: ignored
    assert book.prior("train-lm").cpu_cores == 3.0


def test_the_book_keeps_the_newest_runs_and_signatures_only() -> None:
    book = PriorBook(PriorConfig(min_runs=1, margin=0.0, min_run_s=0.0, keep=2, max_signatures=2))
    for i, cpu in enumerate([5.0, 1.0, 2.0]):
        book.learn(profile(f"r{i}", cpu, 1.0, start=float(i)))
    assert [p.container for p in book.runs("train-lm")] == ["r1", "r2"]
    assert book.prior("train-lm").cpu_cores == 2.0  # the run that started first is gone
    book.learn(profile("x", 1.0, 1.0, signature="s2"))
    book.learn(profile("y", 1.0, 1.0, signature="s3"))
    assert len(book) == 2 and book.prior("train-lm") is None


def test_priors_off_and_bad_configs() -> None:
    book = PriorBook(PriorConfig(min_runs=0, margin=0.1, min_run_s=0.0))
    book.learn(profile("a", 1.0, 1.0))
    assert book.prior("train-lm") is None
    for bad in ({"min_runs": -1}, {"margin": float("nan")}, {"min_run_s": -1.0}, {"min_runs": 9}):
        with pytest.raises(ValueError):
            PriorConfig(**{"min_runs": 2, "margin": 0.1, "min_run_s": 0.0, **bad})


def test_a_profile_round_trips_and_bad_ones_are_refused() -> None:
    p = profile("a", 1.5, 3e8)
    assert decode(ExecutionProfile, encode(p)) == p
    for bad in (None, b"null", b"{}", b'{"signature": "../x", "host": "h", "container": "a", "ts": 1, '
                b'"start": 0, "samples": 1, "cpu_peak_cores": 1, "mem_peak_bytes": 1}',
                json.dumps({**json.loads(encode(p)), "cpu_peak_cores": -1}).encode()):
        with pytest.raises(Exception) as e:
            decode(ExecutionProfile, bad)
        assert type(e.value).__name__ == "SchemaError"


def test_the_signature_comes_from_an_annotation_or_the_policy_file() -> None:
    own = parse_settings({"phasewise.io/signature": "bert-finetune"})
    assert resolve(own, "kubepods-systemd").signature == "bert-finetune"
    bad = resolve(parse_settings({"phasewise.io/signature": "a b"}), "kubepods-systemd")
    assert bad.mode == "off" and "signature" in bad.error


# ------------------------------------------------------------------ the worker's step

RULES = {"safety_min_history_s": 900.0, "safety_cooldown_s": 300.0, "mem_margin_bytes": 32 * MIB,
         "recommend_interval_s": 5.0, "prior_min_runs": 2, "prior_margin": 0.1, "prior_min_run_s": 30.0,
         "prior_profile_interval_s": 15.0}


class Host:
    """One host's containers through the worker's step (the VPA updater with the safety rules)."""

    def __init__(self, **kw) -> None:
        self.s = Settings.from_env({**RULES, **kw}, env={})
        self.cache = state_cache(self.s)
        self.config = updater_config(self.s)
        self.profiles: list[ExecutionProfile] = []

    def tick(self, t: float, containers: dict[str, tuple[float, float, str | None]], throttled: bool = False):
        cs = tuple(ContainerSample(container=name, cpu_cores=cpu, mem_bytes=mem, nr_periods=10,
                                   throttled_periods=10 if throttled else 0,
                                   workload=WorkloadPolicy(mode="apply", signature=sig))
                   for name, (cpu, mem, sig) in containers.items())
        out = process_host_samples(self.cache, HostSamples(host="h", ts=t, interval_s=1.0, containers=cs),
                                   self.config)
        self.profiles += self.cache.pop_profiles()
        return out


def earlier_runs(host: Host, t0: float = 1000.0) -> float:
    """Two runs of train-lm, 120 s each (peaks 1.0 and 1.2 cores, 400 and 500 MiB); returns the time after."""
    for k in range(120):
        host.tick(t0 + k, {"run-1": (1.0 if k % 10 else 0.5, 400 * MIB, "train-lm"),
                           "run-2": (1.2 if k % 10 else 0.6, (500 if k > 60 else 300) * MIB, "train-lm")})
    return t0 + 120


def test_a_new_run_of_a_known_job_is_limited_from_its_prior_at_once() -> None:
    host = Host()
    t = earlier_runs(host)
    assert {p.container for p in host.profiles} == {"run-1", "run-2"}
    assert max(p.mem_peak_bytes for p in host.profiles if p.container == "run-2") == 500 * MIB
    got = []
    for k in range(30):
        got += host.tick(t + k, {"run-3": (0.9, 350 * MIB, "train-lm"), "stranger": (0.9, 350 * MIB, None)})
    assert [d.container for d in got] == ["run-3"]  # the unsigned container has no history: nothing set
    d = got[0]
    assert d.cpu_limit_cores == pytest.approx(1.32) and d.mem_limit_bytes == pytest.approx(550 * MIB, abs=1)
    assert d.details["prior"]["runs"] == 2 and d.details["prior"]["signature"] == "train-lm"
    assert d.reason.startswith("prior of 2 earlier runs of train-lm")
    assert "history" not in d.details["safety"]["bounded_by"].get("cpu", [])


def test_a_prior_never_sets_memory_under_the_runs_own_peak_nor_cpu_while_throttled() -> None:
    host = Host()
    t = earlier_runs(host)
    got = []
    for k in range(12):  # a bigger run: 800 MiB, over the prior's 550
        got += host.tick(t + k, {"run-3": (2.0, 800 * MIB, "train-lm")})
    mem = [d.mem_limit_bytes for d in got if d.mem_limit_bytes is not None]
    assert mem and min(mem) >= 800 * MIB * 1.1 - 1  # the run's own peak x (1 + margin)
    cpu = [d.cpu_limit_cores for d in got if d.cpu_limit_cores is not None]
    assert cpu and min(cpu) >= 2.2 - 1e-9
    throttled = Host()
    t = earlier_runs(throttled)
    got = []
    for k in range(12):
        got += throttled.tick(t + k, {"run-3": (0.9, 300 * MIB, "train-lm")}, throttled=True)
    assert got and all(d.cpu_limit_cores is None for d in got)
    assert "throttled" in got[0].details["safety"]["bounded_by"]["cpu"]


def test_without_earlier_runs_or_with_priors_off_a_signed_run_waits_for_history() -> None:
    host = Host()
    assert not [d for k in range(30) for d in host.tick(1000.0 + k, {"run-1": (1.0, 400 * MIB, "train-lm")})]
    off = Host(prior_min_runs=0)
    t = earlier_runs(off)
    assert off.profiles == [] and off.cache.priors is None
    assert not [d for k in range(30) for d in off.tick(t + k, {"run-3": (0.9, 350 * MIB, "train-lm")})]


def test_a_runs_profile_is_kept_in_its_stored_state() -> None:
    host = Host()
    earlier_runs(host)
    state = host.cache.state_of("h/run-2")
    assert state["x"][1:] == [120.0, 1.2, 500 * MIB]
    again = state_cache(host.s, loader={"h/run-2": state}.get)
    again.row("h/run-2")
    assert again.state_of("h/run-2")["x"] == state["x"]
    with pytest.raises(ValueError):
        state_cache(host.s).__class__._load(again, 0, {**state, "x": [1, 2]})
