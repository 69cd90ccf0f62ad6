"""The inference autoscaler: utilisation and SLO rule, cool-downs, bounds and the rule each decision names;
the signal of a service from its replicas' histograms; the step from job events and scrapes to signed-job
``scale`` decisions."""

from __future__ import annotations

import pytest

from phasewise.models.jobs.autoscaler import Autoscaler, AutoscalerConfig


def scaler(**kw) -> Autoscaler:
    cfg = dict(slo_p99_ms=100, target_util=0.5, min_replicas=1, max_replicas=4, up_cooldown_s=10,
               down_cooldown_s=60, max_step=2, tolerance=0.1, down_latency_fraction=0.5, up_step=1)
    return Autoscaler(AutoscalerConfig(**{**cfg, **kw}))


def test_utilisation_scales_like_hpa_within_tolerance_nothing():
    a = scaler()
    assert a.step(now=0, replicas=2, util=0.53, p99_ms=20) is None      # 6 % off target: tolerated
    s = a.step(now=0, replicas=2, util=0.9, p99_ms=20)
    assert (s.current, s.replicas) == (2, 4) and "utilisation" in s.reason


def test_latency_over_the_slo_adds_a_replica_even_at_low_utilisation():
    s = scaler().step(now=0, replicas=1, util=0.3, p99_ms=150)
    assert s.replicas == 2 and "p99 150 ms > SLO 100 ms" in s.reason


def test_no_scale_down_while_latency_is_near_the_slo():
    a = scaler()
    assert a.step(now=0, replicas=3, util=0.1, p99_ms=80) is None        # 80 > 0.5 x 100
    assert a.step(now=0, replicas=3, util=0.1, p99_ms=30).replicas == 1


def test_cool_downs():
    a = scaler()
    assert a.step(now=0, replicas=1, util=0.9, p99_ms=200).replicas == 2
    assert a.step(now=9.9, replicas=2, util=0.9, p99_ms=200) is None     # up cool-down
    assert a.step(now=10, replicas=2, util=0.9, p99_ms=200).replicas == 4
    assert a.step(now=60, replicas=4, util=0.05, p99_ms=5) is None       # down cool-down from the last change
    assert a.step(now=70, replicas=4, util=0.05, p99_ms=5).replicas == 2  # at most max_step down
    assert a.step(now=129, replicas=2, util=0.05, p99_ms=5) is None
    assert a.step(now=130, replicas=2, util=0.05, p99_ms=5).replicas == 1


def test_bounds_and_step_limits():
    a = scaler(max_replicas=3, target_util=0.25)  # wants 4
    assert a.step(now=0, replicas=1, util=1.0, p99_ms=500).replicas == 3   # +2 at most, and max 3
    assert a.step(now=100, replicas=3, util=1.0, p99_ms=500) is None      # at max: nothing to do
    assert scaler().step(now=0, replicas=1, util=0.0, p99_ms=1) is None  # at min
    assert scaler().step(now=0, replicas=7, util=0.5, p99_ms=1).replicas == 4   # outside: back inside at once
    assert scaler().step(now=0, replicas=2, util=None, p99_ms=None) is None   # no signal, no change


def test_state_round_trip_keeps_the_cool_down():
    a = scaler()
    a.step(now=0, replicas=1, util=0.9, p99_ms=200)
    b = Autoscaler.from_state(a.config, a.to_state())
    assert b.step(now=5, replicas=2, util=0.9, p99_ms=200) is None


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="min_replicas"):
        scaler(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="slo_p99_ms"):
        scaler(slo_p99_ms=0)


def test_each_decision_names_the_rule_that_set_its_number():
    assert scaler().step(now=0, replicas=2, util=0.9, p99_ms=20).rule == "utilisation"   # ceil(2 x 1.8) = 4
    assert scaler().step(now=0, replicas=1, util=0.3, p99_ms=150).rule == "slo"
    s = scaler(max_replicas=3).step(now=0, replicas=2, util=1.0, p99_ms=20)            # wants 4
    assert (s.replicas, s.rule) == (3, "max_replicas") and "bounded by max_replicas (3)" in s.reason
    s = scaler(max_replicas=10).step(now=0, replicas=2, util=1.0, p99_ms=20)           # wants 4, +2 at most
    assert (s.replicas, s.rule) == (4, "utilisation")
    s = scaler(max_replicas=10).step(now=0, replicas=3, util=1.0, p99_ms=20)           # wants 6, +2 at most
    assert (s.replicas, s.rule) == (5, "max_step") and "bounded by max_step (2)" in s.reason
    s = scaler(min_replicas=2).step(now=0, replicas=3, util=0.05, p99_ms=5)           # wants 1
    assert (s.replicas, s.rule) == (2, "min_replicas")
    assert scaler().step(now=0, replicas=6, util=0.5, p99_ms=1).rule == "bounds"


def test_a_services_spec_sets_its_own_slo_and_bounds():
    from phasewise.kit.records import JobService

    cfg = scaler().config.for_service(JobService(port=20000, slo_p99_ms=50, max_replicas=2))
    assert (cfg.slo_p99_ms, cfg.min_replicas, cfg.max_replicas) == (50, 1, 2)
    assert scaler().config.for_service(JobService(port=20000)) == scaler().config


# --------------------------------------------------------------------------- the signal

INF = float("inf")


def test_histogram_quantile_interpolates_inside_its_bucket_as_prometheus():
    from phasewise.models.jobs.autoscaler import histogram_quantile

    b = [(0.05, 50.0), (0.1, 90.0), (0.25, 99.0), (0.5, 100.0), (INF, 100.0)]
    assert histogram_quantile(0.5, b) == 0.05
    assert histogram_quantile(0.99, b) == pytest.approx(0.25)
    assert histogram_quantile(0.95, b) == pytest.approx(0.1 + 0.15 * 5 / 9)
    assert histogram_quantile(0.99, [(0.1, 0.0), (INF, 0.0)]) is None           # nothing observed
    assert histogram_quantile(0.99, [(0.1, 1.0), (0.2, 2.0), (INF, 100.0)]) == 0.2  # beyond the last finite bound


def test_the_signal_sums_the_replicas_increases_and_survives_a_restart():
    from phasewise.models.jobs.autoscaler import Scrape, service_signal

    def s(t, fast, slow, cpu):  # cumulative: `fast` requests <= 10 ms, `slow` more in (10 ms, 1 s]
        return Scrape(t=t, buckets=((0.01, fast), (1.0, fast + slow), (INF, fast + slow)), count=fast + slow,
                      cpu_seconds=cpu)

    a0, a1 = s(0, 100, 0, 5.0), s(10, 190, 10, 7.0)      # replica a: 100 more requests, 10 slow; 0.2 CPU
    b0, b1 = s(0, 1000, 0, 50.0), s(10, 90, 0, 1.0)      # replica b restarted: its counters went down
    sig = service_signal([(a0, a1), (b0, b1), (None, None)], cpu_cores=0.5)
    assert sig.answered == 2
    assert sig.rate_rps == pytest.approx((100 + 90) / 10)
    assert sig.util == pytest.approx((2.0 / 10 / 0.5 + 1.0 / 10 / 0.5) / 2)
    # 190 requests, 10 slow: the p99 (rank 188.1) lies in the slow bucket
    assert 10 < sig.p99_ms <= 1000
    first = service_signal([(None, a0)], cpu_cores=0.5)   # a first scrape: no interval yet, no signal
    assert (first.p99_ms, first.rate_rps, first.util, first.answered) == (None, None, None, 1)
    assert service_signal([(a0, a1)], cpu_cores=None).util is None


# --------------------------------------------------------------------------- the step

HOST = "h1"


def step_config(**kw):
    from phasewise.models.jobs.autoscaler import AutoscaleStepConfig

    return AutoscaleStepConfig(scaler=scaler(up_cooldown_s=0, **kw).config, latency_metric="req_seconds",
                               cpu_metric="process_cpu_seconds_total", partitions=4)


def make_step(**kw):
    from phasewise.kit.job_signing import start_details
    from phasewise.models.jobs.autoscaler import AutoscaleStep
    from phasewise.models.jobs.submissions import Submissions

    return AutoscaleStep(step_config(**kw), Submissions(start_details))


def service_submitted(job="svc", port=21000, ts=100.0, workload="inference", **svc):
    from phasewise.kit.records import JobRequests, JobService, encode
    from tests.job_keys import submitted

    return encode(submitted(job, ("/usr/bin/python3", "serve.py"), ts=ts, workload=workload,
                            requests=JobRequests(cpu_cores=0.5),
                            service=JobService(port=port, **svc) if port else None))


def started(job="svc", ts=101.0):
    from phasewise.kit.records import JobEvent, encode

    return encode(JobEvent(job=job, ts=ts, kind="started", host=HOST, container=job, pid=4242,
                           workload="inference"))


def slow(t, n):
    """A replica's scrape after *n* requests, all slower than 100 ms."""
    from phasewise.models.jobs.autoscaler import Scrape

    return Scrape(t=t, buckets=((0.1, 0.0), (1.0, float(n)), (INF, float(n))), count=float(n), cpu_seconds=0.1 * t)


def test_the_step_scales_a_started_signed_service_from_its_replicas_metrics():
    from phasewise.kit.job_signing import spec_digest, spec_of

    st = make_step(max_replicas=3)
    st.handle(service_submitted(), 0, 1)
    assert st.targets() == []                                  # not started: nothing to scrape
    st.handle(started(), 0, 2)
    (t,) = st.targets()
    assert t.urls == ("http://127.0.0.1:21001/metrics",) and t.latency_metric == "req_seconds"
    assert st.decide(10.0, {"svc": {t.urls[0]: slow(10, 100)}}) == []   # one scrape: no interval yet
    (d,) = st.decide(20.0, {"svc": {t.urls[0]: slow(20, 300)}})
    assert (d.action, d.host, d.container, d.policy) == ("scale", HOST, "svc", "autoscaler")
    assert d.details["replicas"] == 2 and d.details["current"] == 1 and d.details["rule"] == "slo"
    assert d.details["rate_rps"] == pytest.approx(20.0) and d.details["p99_ms"] > 100
    # the signed start details, as a place decision carries them: the actuator verifies them
    assert d.details["job_signature"].startswith("ed25519:")
    assert d.details["spec_digest"] == spec_digest(spec_of(d.details["spec"]))
    (t,) = st.targets()                                        # now two replicas' endpoints
    assert t.urls == ("http://127.0.0.1:21001/metrics", "http://127.0.0.1:21002/metrics")


def test_the_step_follows_only_signed_inference_services_and_forgets_them_when_they_end():
    from phasewise.kit.job_signing import start_details
    from phasewise.kit.records import JobEvent, encode
    from phasewise.models.jobs.autoscaler import AutoscaleStep
    from phasewise.models.jobs.submissions import Submissions

    st = make_step()
    st.handle(service_submitted("train", workload="training"), 0, 1)
    st.handle(service_submitted("plain", port=None), 0, 2)      # inference without a service section
    assert st.services == {} and sum(st.ignored.values()) == 2
    strict = AutoscaleStep(step_config(), Submissions(start_details, lambda ev: "not signed by a trusted key"))
    strict.handle(service_submitted(), 0, 1)
    assert strict.services == {}
    st.handle(service_submitted(), 0, 3)
    st.handle(started(), 0, 4)
    st.handle(started(), 0, 4)                                  # read again after a restart: nothing more
    assert st.replayed == 1
    part = st.positions.partition("svc")
    st.handle(encode(JobEvent(job="svc", ts=200.0, kind="failed", exit_code=1)), 0, 5)
    assert st.services == {} and st.targets() == []
    assert st.writes()[-1] == ("svc", part, None)  # its key deleted from the table


def test_the_step_state_round_trips_through_the_table():
    st = make_step()
    st.handle(service_submitted(), 1, 7)
    st.handle(started(), 1, 8)
    url = st.targets()[0].urls[0]
    st.decide(10.0, {"svc": {url: slow(10, 100)}})
    (d,) = st.decide(20.0, {"svc": {url: slow(20, 300)}})
    (w,) = st.writes()
    again = make_step()
    assert again.restore([(w[0], w[2])]) == 1
    assert again.services["svc"]["n"] == 2 and again.positions.offset("svc") == 8
    # the cool-down is kept: a second change at once is held back (down_cooldown_s = 60)
    u1, u2 = (f"http://127.0.0.1:{21000 + k}/metrics" for k in (1, 2))
    quiet = {u1: slow(30, 300), u2: slow(30, 300)}
    assert again.decide(30.0, {"svc": quiet}) == []
    assert again.decide(40.0, {"svc": {u1: slow(40, 300), u2: slow(40, 300)}}) == []  # util 20 %: wants 1
    assert again.restore([("bad", b"{not json")]) == 0


def test_a_service_with_a_metrics_url_is_scraped_there_and_no_answer_changes_nothing():
    st = make_step()
    st.handle(service_submitted(metrics_url="http://prometheus.example:9090/federate?match=svc",
                                deployment="serving/svc"), 0, 1)
    st.handle(started(), 0, 2)
    (t,) = st.targets()
    assert t.urls == ("http://prometheus.example:9090/federate?match=svc",)
    assert st.decide(10.0, {"svc": {t.urls[0]: None}}) == [] and st.decide(20.0, {"svc": {t.urls[0]: None}}) == []


def scaled(replicas, most=None, job="svc", ts=130.0):
    from phasewise.kit.records import JobEvent, encode

    return encode(JobEvent(job=job, ts=ts, kind="scaled", host=HOST, container=job, replicas=replicas,
                           max_replicas=most, workload="inference"))


def test_the_actuators_scaled_state_sets_the_replica_count_and_caps_what_is_asked_after():
    """Asked for 3, the actuator runs 2 (its actuator_max_replicas): the step scrapes 2, asks for no more."""
    st = make_step(max_replicas=4, max_step=2)
    st.handle(service_submitted(), 0, 1)
    st.handle(started(), 0, 2)
    u1, u2, u3 = (f"http://127.0.0.1:{21000 + k}/metrics" for k in (1, 2, 3))
    st.decide(10.0, {"svc": {u1: slow(10, 100)}})
    (d,) = st.decide(20.0, {"svc": {u1: slow(20, 300)}})
    assert d.details["replicas"] == 2
    # slower still: 2 -> 3 asked (the step believes what it asked for until the actuator says otherwise)
    st.decide(30.0, {"svc": {u1: slow(30, 300), u2: slow(30, 100)}})
    (d,) = st.decide(40.0, {"svc": {u1: slow(40, 600), u2: slow(40, 400)}})
    assert d.details["replicas"] == 3 and st.targets()[0].urls[-1] == u3
    st.handle(scaled(2, most=2), 0, 3)                           # the actuator runs 2 at most
    assert st.services["svc"]["n"] == 2 and st.targets()[0].urls == (u1, u2)
    # still slow: nothing more is asked (the service is at the most its actuator runs)
    st.decide(50.0, {"svc": {u1: slow(50, 600), u2: slow(50, 400)}})
    assert st.decide(60.0, {"svc": {u1: slow(60, 900), u2: slow(60, 700)}}) == []
    # a replica ended on its own: one runs, the step asks for the second again (up to the cap)
    st.handle(scaled(1, most=2, ts=131.0), 0, 4)
    st.decide(70.0, {"svc": {u1: slow(70, 900)}})
    (d,) = st.decide(80.0, {"svc": {u1: slow(80, 1200)}})
    assert (d.details["current"], d.details["replicas"]) == (1, 2)
    assert u3 not in st.targets()[0].urls
    # the cap is part of the state: a restored step keeps it
    (w,) = st.writes()
    again = make_step(max_replicas=4, max_step=2)
    again.restore([(w[0], w[2])])
    assert again.services["svc"]["most"] == 2
    assert again._scaler("svc").config.max_replicas == 2


def test_a_scaled_state_needs_the_cluster_keys_signature_and_one_before_started_changes_nothing():
    from phasewise.kit.job_signing import start_details
    from phasewise.models.jobs.autoscaler import AutoscaleStep
    from phasewise.models.jobs.events import SignatureRefused
    from phasewise.models.jobs.submissions import Submissions

    st = AutoscaleStep(step_config(), Submissions(start_details), verify=lambda k, raw, h: "no signature")
    st.handle(service_submitted(), 0, 1)
    with pytest.raises(SignatureRefused, match="scaled svc: not signed by the cluster key"):
        st.handle(scaled(3), 0, 2)
    plain = make_step()
    plain.handle(service_submitted(), 0, 1)
    plain.handle(scaled(3), 0, 2)                                # before its started event: nothing to count
    assert plain.services["svc"]["n"] is None and plain.targets() == []
