"""Per-workload policy: annotation and policy-file parsing, and how the mode is resolved."""

from __future__ import annotations

import pytest

from phasewise.models.safety.workload import (
    WorkloadError,
    match_rule,
    parse_policy_file,
    parse_settings,
    resolve,
)

P = "phasewise.io/"


def ann(**kw):
    return {P + k.replace("_", "-"): v for k, v in kw.items()}


@pytest.mark.parametrize("values, field, want", [
    (ann(mode="off"), "mode", "off"),
    (ann(mode="recommend"), "mode", "recommend"),
    (ann(mode="apply"), "mode", "apply"),
    (ann(policy="phase"), "policy", "phase"),
    (ann(cpu_min="250m"), "cpu_min_cores", 0.25),
    (ann(cpu_max="2"), "cpu_max_cores", 2.0),
    (ann(cpu_max="1.5"), "cpu_max_cores", 1.5),
    (ann(cpu_max="2e0"), "cpu_max_cores", 2.0),
    (ann(memory_min="512Mi"), "mem_min_bytes", 512 * 2**20),
    (ann(memory_max="1G"), "mem_max_bytes", 1e9),
    (ann(memory_max="1.5Gi"), "mem_max_bytes", 1.5 * 2**30),
    (ann(memory_max="1000"), "mem_max_bytes", 1000.0),
    (ann(priority="-3"), "priority", -3),
    (ann(priority="10"), "priority", 10),
    (ann(**{"class": "inference"}), "workload_class", "inference"),
    (ann(job="train-42"), "job", "train-42"),
])
def test_each_annotation_is_parsed(values, field, want):
    s = parse_settings({**values, "app.kubernetes.io/name": "x"})
    assert s.error is None
    assert getattr(s, field) == want
    assert s.source == "annotation"


@pytest.mark.parametrize("values, says", [
    (ann(mode="Apply"), "phasewise.io/mode: 'Apply' is not one of off, recommend, apply"),
    (ann(mode=""), "phasewise.io/mode: '' is not one of"),
    (ann(mode="true"), "phasewise.io/mode: 'true'"),
    (ann(policy="vpa2"), "phasewise.io/policy: 'vpa2' is not one of vpa, phase"),
    (ann(cpu_max="two"), "phasewise.io/cpu-max: 'two' is not a quantity"),
    (ann(cpu_max="-1"), "phasewise.io/cpu-max: '-1' is not a quantity"),
    (ann(cpu_max="nan"), "phasewise.io/cpu-max: 'nan' is not a quantity"),
    (ann(cpu_max="1e400"), "phasewise.io/cpu-max: '1e400' is not a finite quantity"),
    (ann(cpu_max="5000"), "more than 4096 cores"),
    (ann(memory_max="1Zi"), "phasewise.io/memory-max: '1Zi' is not a quantity"),
    (ann(memory_max="128PB"), "phasewise.io/memory-max"),
    (ann(memory_max="100Pi"), "more than"),
    (ann(cpu_min="2", cpu_max="1"), "phasewise.io/cpu-min (2) is above phasewise.io/cpu-max (1)"),
    (ann(memory_min="2Gi", memory_max="1Gi"), "phasewise.io/memory-min (2Gi) is above phasewise.io/memory-max (1Gi)"),
    (ann(priority="high"), "phasewise.io/priority: 'high' is not an integer"),
    (ann(priority="1.5"), "phasewise.io/priority: '1.5' is not an integer"),
    (ann(priority="99999999999"), "outside"),
    (ann(**{"class": "Training Jobs"}), "phasewise.io/class: 'Training Jobs' is not a lower-case word"),
    (ann(job="../etc"), "phasewise.io/job: '../etc' is not a job id"),
    (ann(job="a b"), "phasewise.io/job: 'a b' is not a job id"),
    ({P + "cpu_max": "2"}, "phasewise.io/cpu_max: unknown key"),
    ({P + "mode": "apply", P + "memory-limit": "1Gi"}, "phasewise.io/memory-limit: unknown key"),
])
def test_a_bad_value_refuses_the_whole_workload_with_the_reason(values, says):
    s = parse_settings(values)
    assert s.error is not None and says in s.error, s.error
    p = resolve(s, "kubepods-systemd", "apply")  # even with apply as the host default
    assert p.mode == "off" and p.error == s.error
    assert p.cpu_max_cores is None and p.mem_max_bytes is None  # nothing of it is used


def test_no_phasewise_annotations_means_no_settings():
    assert parse_settings({}) is None
    assert parse_settings(None) is None
    assert parse_settings({"kubernetes.io/config.source": "api", "phasewise.io": "x"}) is None


@pytest.mark.parametrize("default, layout, want", [
    ("auto", "flat", "apply"),
    ("auto", "kubepods-systemd", "off"),
    ("auto", "kubepods-cgroupfs", "off"),
    ("auto", "docker-systemd", "off"),
    ("auto", "docker-cgroupfs", "off"),
    ("off", "flat", "off"),
    ("recommend", "kubepods-systemd", "recommend"),
    ("apply", "docker-cgroupfs", "apply"),
])
def test_the_host_default_mode(default, layout, want):
    p = resolve(None, layout, default)
    assert (p.mode, p.source) == (want, "default")


def test_own_settings_without_a_mode_keep_the_default_mode_and_their_bounds():
    p = resolve(parse_settings(ann(cpu_max="1")), "kubepods-systemd", "auto")
    assert (p.mode, p.source, p.cpu_max_cores) == ("off", "annotation", 1.0)
    p = resolve(parse_settings(ann(cpu_max="1")), "flat", "auto")
    assert p.mode == "apply"


def test_the_annotation_mode_beats_the_default():
    assert resolve(parse_settings(ann(mode="off")), "flat", "apply").mode == "off"
    assert resolve(parse_settings(ann(mode="apply")), "kubepods-systemd", "off").mode == "apply"


def test_a_default_mode_outside_the_choices_is_refused():
    with pytest.raises(ValueError):
        resolve(None, "flat", "on")


def test_policy_file_rules_match_by_glob_first_rule_wins():
    rules = parse_policy_file({"workloads": [
        {"match": "train-*", "mode": "apply", "cpu-max": "4", "memory-max": "8Gi", "class": "training"},
        {"match": "ml/*/server", "mode": "recommend"},
        {"match": "*", "mode": "off"},
    ]})
    s = match_rule(rules, ["train-7", "abc"])
    assert (s.mode, s.cpu_max_cores, s.mem_max_bytes, s.workload_class, s.source) == (
        "apply", 4.0, 8 * 2**30, "training", "policy-file")
    assert match_rule(rules, [None, "ml/serve-0/server"]).mode == "recommend"
    assert match_rule(rules, ["web"]).mode == "off"
    assert match_rule(rules[:1], ["web", None]) is None


@pytest.mark.parametrize("doc, says", [
    ([], "expected an object with a 'workloads' list"),
    ({"workload": []}, "unknown top-level key 'workload'"),
    ({"workloads": {}}, "'workloads' must be a list"),
    ({"workloads": ["x"]}, "workloads[0]: expected an object"),
    ({"workloads": [{"mode": "apply"}]}, "workloads[0]: 'match' (a glob on the container name) is required"),
    ({"workloads": [{"match": "a"}]}, "workloads[0]: no settings besides 'match'"),
    ({"workloads": [{"match": "a", "mode": "apply"}, {"match": "b", "mode": "yes"}]},
     "workloads[1] (b): mode: 'yes' is not one of off, recommend, apply"),
    ({"workloads": [{"match": "a", "cpu-max": 2, "cpu-min": 3}]}, "workloads[0] (a): cpu-min (3) is above cpu-max (2)"),
    ({"workloads": [{"match": "a", "priority": True}]}, "priority: True is not an integer"),
    ({"workloads": [{"match": "a", "cpu_max": 2}]}, "cpu_max: unknown key"),
])
def test_a_bad_policy_file_is_refused_as_a_whole_naming_the_rule(doc, says):
    with pytest.raises(WorkloadError) as e:
        parse_policy_file(doc)
    assert says in str(e.value)
    assert "\n" not in str(e.value)


def test_policy_file_numbers_may_be_plain_numbers():
    (r,) = parse_policy_file({"workloads": [{"match": "a", "cpu-min": 0.5, "memory-max": 2**30, "priority": 3}]})
    assert (r.settings.cpu_min_cores, r.settings.mem_max_bytes, r.settings.priority) == (0.5, 2**30, 3)


def test_a_containers_own_annotation_wins_over_the_pods():
    a = {P + "mode": "apply", P + "cpu-max": "4", "logger." + P + "mode": "off", "trainer." + P + "cpu-max": "2"}
    assert parse_settings(a, container="logger").mode == "off"
    t = parse_settings(a, container="trainer")
    assert (t.mode, t.cpu_max_cores) == ("apply", 2.0)
    assert parse_settings(a, container="other").cpu_max_cores == 4.0
    assert parse_settings(a).cpu_max_cores == 4.0  # container unknown: the pod's
    only_own = parse_settings({"web." + P + "mode": "recommend"}, container="web")
    assert only_own.mode == "recommend"
    assert parse_settings({"web." + P + "mode": "recommend"}, container="db") is None


def test_a_bad_container_annotation_names_its_key_and_refuses_only_that_container():
    a = {P + "mode": "apply", "logger." + P + "mode": "of", "logger." + P + "cpu-min": "2", P + "cpu-max": "1"}
    assert parse_settings(a, container="trainer").error is None
    assert parse_settings(a, container="logger").error.startswith("logger.phasewise.io/mode: 'of' is not one of")
    del a["logger." + P + "mode"]
    assert parse_settings(a, container="logger").error == (
        "logger.phasewise.io/cpu-min (2) is above phasewise.io/cpu-max (1)")


def test_the_job_a_workload_says_it_is_reaches_its_policy():
    p = resolve(parse_settings(ann(mode="apply", job="train-42")), "kubepods-systemd")
    assert (p.mode, p.job) == ("apply", "train-42")
    assert resolve(None, "flat").job is None


def test_an_annotated_pod_s_settings_resolve_to_its_policy():
    """The module's former example: a mode and a cpu-max from annotations, in the record the agent publishes."""
    got = resolve(parse_settings({"phasewise.io/mode": "recommend", "phasewise.io/cpu-max": "1500m"}), "flat")
    assert (got.mode, got.source, got.cpu_max_cores, got.error) == ("recommend", "annotation", 1.5, None)
    assert (got.cpu_min_cores, got.mem_min_bytes, got.mem_max_bytes, got.policy) == (None, None, None, None)
