"""``experiment corpus live``: the figures read from a run's samples and decisions, and (root) a short live run
where the second execution of a kind starts from the first one's profile, through produce, worker and
actuate."""

from __future__ import annotations

import pytest

from phasewise.apps.experiment.corpus_live import execution_figures, live
from phasewise.apps.experiment.corpus_plan import CorpusError
from phasewise.kit.records import ContainerSample, Decision
from tests.conftest import is_root

MIB = 2**20


def sample(cpu_limit: float | None, mem_limit: float | None, throttled: int = 0, oom: int = 0) -> ContainerSample:
    return ContainerSample(container="r", cpu_cores=0.5, mem_bytes=100 * MIB, cpu_limit_cores=cpu_limit,
                           mem_limit_bytes=mem_limit, nr_periods=10, throttled_periods=throttled, oom_events=oom)


def test_the_figures_of_one_run():
    samples = [(10.0, sample(None, None)), (11.0, sample(1.0, 200 * MIB)), (12.0, sample(1.0, 200 * MIB, 5)),
               (13.0, sample(0.8, 200 * MIB, 5, oom=1)), (14.0, sample(0.9, 200 * MIB))]
    d = Decision(id="x", ts=11.0, host="h", container="r", action="limit", policy="vpa", reason="r",
                 cpu_limit_cores=1.0, details={"prior": {"runs": 1}})
    f = execution_figures(list(reversed(samples)), [d])  # any order
    assert f["samples"] == 5 and f["limited_samples"] == 4 and f["first_limit_after_s"] == 1.0
    assert f["cpu_alloc_over_used"] == pytest.approx((1.0 + 1.0 + 0.8 + 0.9) / 2.0, abs=1e-3)
    assert f["mem_alloc_over_used"] == 2.0
    # 12 -> 13: lowered after a throttled sample; 13 -> 14: raised
    assert f["cpu_cuts_while_throttled"] == 1 and f["throttled_samples"] == 2 and f["oom_kills"] == 1
    assert f["decisions"] == 1 and f["decisions_from_prior"] == 1


def test_bad_arguments_are_refused_before_anything_starts():
    for kw, what in (({"kind": "resnet"}, "unknown job kind"), ({"earlier": 0}, "at least 1"),
                     ({"seconds": 0.0}, "above 0")):
        args = {"kind": "mlp", "earlier": 1, "new": 1, **kw}
        seconds = args.pop("seconds", None)
        with pytest.raises(CorpusError, match=what):
            live(args["kind"], args["earlier"], args["new"], seconds=seconds)


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.skipif(not is_root(), reason="needs root to create cgroups")
def test_a_second_run_of_a_kind_starts_from_the_first_through_the_roles():
    res = live("mlp", 1, 1, seconds=12)
    cold, known = res["runs"]
    assert not cold["prior_possible"] and known["prior_possible"]
    assert cold["decisions_from_prior"] == 0 and cold["limited_samples"] == 0  # the history rule: unlimited
    assert known["decisions_from_prior"] >= 1 and known["limited_samples"] > 0, known
    assert known["first_limit_after_s"] is not None and known["first_limit_after_s"] < 20, known
    assert known["mem_alloc_over_used"] is not None and known["mem_alloc_over_used"] >= 1.0
    for r in (cold, known):
        assert r["oom_kills"] == 0 and r["cpu_cuts_while_throttled"] == 0, r
