"""Settings: frozen groups that check themselves, named flat as users name them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from phasewise.kit.settings import (
    GROUPS,
    SPECS,
    KafkaSettings,
    PhaseSettings,
    Settings,
    SettingsError,
    VpaSettings,
    WorkerSettings,
)

#: every setting's name (= ``PHASEWISE_<NAME>``) -> where code reads it
WHERE = {
    "host": "host", "log_level": "log_level", "data_dir": "data_dir",
    "metrics_port": "metrics_port",
    "bootstrap": "kafka.bootstrap", "session_timeout_ms": "kafka.session_timeout_ms",
    "heartbeat_interval_ms": "kafka.heartbeat_interval_ms",
    "fetch_wait_max_ms": "kafka.fetch_wait_max_ms", "create_topics": "kafka.create_topics",
    "topic_partitions": "kafka.topic_partitions",
    "dead_letter_max_bytes": "kafka.dead_letter_max_bytes",
    "cgroup_root": "cgroup.root", "cgroup_prefix": "cgroup.prefix",
    "cgroup_layout": "cgroup.layout", "cgroup_parent": "cgroup.parent",
    "interval_s": "producer.interval_s", "buffer_max_messages": "producer.buffer_max_messages",
    "flush_timeout_s": "producer.flush_timeout_s", "proc_root": "producer.proc_root",
    "worker_id": "worker.id", "web_port": "worker.web_port", "scorecard_samples": "worker.scorecard_samples",
    "scorecard_buckets": "worker.scorecard_buckets",
    "scorecard_windows": "worker.scorecard_windows", "policy": "worker.policy",
    "phase_workloads": "worker.phase_workloads",
    "prior_min_runs": "worker.prior_min_runs", "prior_margin": "worker.prior_margin",
    "prior_min_run_s": "worker.prior_min_run_s", "prior_profile_interval_s": "worker.prior_profile_interval_s",
    "recommend_interval_s": "worker.recommend_interval_s", "hysteresis": "worker.hysteresis",
    "worker_hosts": "worker.hosts", "state_write_interval_s": "worker.state_write_interval_s",
    "container_ttl_s": "worker.container_ttl_s", "worker_batch_max": "worker.batch_max",
    "worker_batch_wait_ms": "worker.batch_wait_ms", "ready_stall_s": "worker.ready_stall_s",
    "start_stall_s": "worker.start_stall_s", "heap_trim_interval_s": "worker.heap_trim_interval_s",
    "vpa_time_scale": "vpa.time_scale", "vpa_min_cpu_cores": "vpa.min_cpu_cores",
    "vpa_min_mem_bytes": "vpa.min_mem_bytes", "vpa_throttle_threshold": "vpa.throttle_threshold",
    "vpa_throttle_bump": "vpa.throttle_bump", "vpa_update_mode": "vpa.update_mode",
    "phase_snapshot_interval_s": "phase.snapshot_interval_s",
    "phase_learn_every": "phase.learn_every", "phase_warmup": "phase.warmup",
    "phase_statistics": "phase.statistics", "phase_learn_batch": "phase.learn_batch",
    "phase_features": "phase.features", "phase_pretrained": "phase.pretrained",
    "phase_pretrained_model": "phase.pretrained_model",
    "phase_anticipate_horizon_s": "phase.anticipate_horizon_s",
    "phase_anticipate_min_probability": "phase.anticipate_min_probability",
    "phase_anticipate_min_exits": "phase.anticipate_min_exits",
    "phase_ratio_cap": "phase.ratio_cap",
    "phase_cpu_margin": "phase.cpu_margin",
    "phase_mem_margin": "phase.mem_margin",
    "phase_snapshot_max_bytes": "phase.snapshot_max_bytes",
    "phase_snapshot_max_unpacked_bytes": "phase.snapshot_max_unpacked_bytes",
    "phase_snapshot_max_version_step": "phase.snapshot_max_version_step",
    "safety_rules": "safety.rules", "safety_min_history_s": "safety.min_history_s",
    "safety_cooldown_s": "safety.cooldown_s", "safety_max_decrease": "safety.max_decrease",
    "safety_peak_window_s": "safety.peak_window_s",
    "backend": "actuator.backend", "kube_api": "actuator.kube_api", "cpu_floor_cores": "actuator.cpu_floor_cores",
    "kube_resize_deferred_timeout_s": "actuator.kube_resize_deferred_timeout_s",
    "kube_resize_in_progress_timeout_s": "actuator.kube_resize_in_progress_timeout_s",
    "kube_resize_check_s": "actuator.kube_resize_check_s",
    "mem_margin_bytes": "actuator.mem_margin_bytes",
    "mem_floor_bytes": "actuator.mem_floor_bytes", "apply_retries": "actuator.apply_retries",
    "apply_retry_backoff_s": "actuator.apply_retry_backoff_s",
    "ledger_max_age_days": "actuator.ledger_max_age_days",
    "ledger_max_rows": "actuator.ledger_max_rows",
    "workload_default_mode": "workload.default_mode", "workload_policy_file": "workload.policy_file",
    "workload_pods": "workload.pods", "workload_pods_token_file": "workload.pods_token_file",
    "workload_pods_refresh_s": "workload.pods_refresh_s", "workload_docker_dir": "workload.docker_dir",
    "workload_pods_ca_file": "workload.pods_ca_file",
    "horus_coverage": "horus.coverage", "horus_warmup_s": "horus.warmup_s", "horus_observe_s": "horus.observe_s",
    "horus_min_samples": "horus.min_samples", "horus_worker_id": "horus.worker_id",
    "horus_share_model": "horus.share_model",
    "horus_model_modules": "horus.model_modules", "horus_build_timeout_s": "horus.build_timeout_s",
    "horus_build_memory_bytes": "horus.build_memory_bytes",
    "place_policy": "place.policy", "place_max_waiting_jobs": "place.max_waiting_jobs",
    "place_isolate_inference": "place.isolate_inference",
    "place_prediction_wait_s": "place.prediction_wait_s", "place_local_nodes": "place.local_nodes",
    "place_worker_id": "place.worker_id", "place_horus_frag_weight": "place.horus_frag_weight",
    "priority_agent": "priority.agent", "priority_host_cpu_cores": "priority.host_cpu_cores",
    "priority_host_mem_bytes": "priority.host_mem_bytes", "priority_host_gpus": "priority.host_gpus",
    "priority_freeze_max_wait_s": "priority.freeze_max_wait_s", "priority_grace_s": "priority.grace_s",
    "priority_cpu_weights": "priority.cpu_weights", "priority_cpu_weight_ratio": "priority.cpu_weight_ratio",
    "priority_launcher": "priority.launcher", "place_after_admission": "place.after_admission",
    "targets_enabled": "targets.enabled", "targets_ewma_alpha": "targets.ewma_alpha",
    "targets_patience": "targets.patience", "targets_grace_s": "targets.grace_s",
    "targets_shrink": "targets.shrink", "targets_node_cores": "targets.node_cores",
    "targets_policy": "targets.policy", "targets_share_alpha": "targets.share_alpha",
    "targets_share_interval_s": "targets.share_interval_s",
    "autoscale_enabled": "autoscale.enabled", "autoscale_interval_s": "autoscale.interval_s",
    "autoscale_slo_p99_ms": "autoscale.slo_p99_ms", "autoscale_target_util": "autoscale.target_util",
    "autoscale_tolerance": "autoscale.tolerance",
    "autoscale_down_latency_fraction": "autoscale.down_latency_fraction",
    "autoscale_min_replicas": "autoscale.min_replicas", "autoscale_max_replicas": "autoscale.max_replicas",
    "autoscale_max_step": "autoscale.max_step", "autoscale_up_step": "autoscale.up_step",
    "autoscale_up_cooldown_s": "autoscale.up_cooldown_s", "autoscale_down_cooldown_s": "autoscale.down_cooldown_s",
    "autoscale_scrape_timeout_s": "autoscale.scrape_timeout_s",
    "autoscale_latency_metric": "autoscale.latency_metric", "autoscale_cpu_metric": "autoscale.cpu_metric",
    "terminate_grace_s": "actuator.terminate_grace_s", "terminate_grace_max_s": "actuator.terminate_grace_max_s",
    "cpu_weight_min": "actuator.cpu_weight_min", "cpu_weight_max": "actuator.cpu_weight_max",
    "actuator_max_replicas": "actuator.max_replicas", "actuator_start_jobs": "actuator.start_jobs",
    "actuator_remove_ended_jobs": "actuator.remove_ended_jobs",
    "job_user": "actuator.job_user",
    "job_group": "actuator.job_group", "job_allow_root": "actuator.job_allow_root", "job_env": "actuator.job_env",
    "decision_max_age_s": "actuator.decision_max_age_s",
    "actuator_read_partitions": "actuator.read_partitions",
    "decision_max_future_s": "actuator.decision_max_future_s",
    "intake_max_future_s": "intake.max_future_s", "intake_max_behind_s": "intake.max_behind_s",
    "intake_max_containers_per_message": "intake.max_containers_per_message",
    "intake_max_containers_per_host": "intake.max_containers_per_host",
    "intake_max_containers_per_worker": "intake.max_containers_per_worker",
    "intake_host_active_s": "intake.host_active_s",
    "signing_key_file": "signing.key_file", "signing_previous_key_file": "signing.previous_key_file",
    "signing_previous_key_until": "signing.previous_key_until",
    "job_submitter_key_file": "jobs.submitter_key_file", "job_trusted_submitters": "jobs.trusted_submitters",
    "job_spec_max_age_s": "jobs.spec_max_age_s", "job_allowed_commands": "jobs.allowed_commands",
    "job_start_timeout_s": "jobs.start_timeout_s",
    "bind_address": "bind_address",
    **{f"kafka_{f}": f"kafka.{f}" for f in (
        "security_protocol", "sasl_mechanism", "sasl_username", "sasl_password", "sasl_password_file",
        "oauth_token_url", "oauth_client_id", "oauth_client_secret", "oauth_client_secret_file", "oauth_scope",
        "ssl_ca_file", "ssl_cert_file", "ssl_key_file", "ssl_key_password", "ssl_key_password_file",
        "ssl_check_hostname")},
}


def read(s: Settings, where: str):
    obj = s
    for part in where.split("."):
        obj = getattr(obj, part)
    return obj


def other_value(name: str):
    """A value setting *name* takes that is not its default."""
    spec, default = SPECS[name], Settings.default(name)
    if spec.kind == "bool":
        return not default
    if spec.choices is not None:
        return next(c for c in spec.choices if c != default)
    if spec.kind == "str":
        candidates = {"phase_features": ["cpu,mem,gpu"],
                      "cgroup_prefix": ["other/prefix"], "place_local_nodes": ["s0=0-1@0;s1=2"],
                      "scorecard_windows": ["30,120"], "job_env": ["OMP_NUM_THREADS=1"],
                      "job_allowed_commands": ["/usr/bin/python3"]}.get(name, ["other"])
    elif spec.kind == "int":
        candidates = [default + 1, default - 1, default + 2]
    else:
        candidates = [default / 2, 0.5, default + 1.0]
    for v in candidates:
        try:
            spec.validate(v)
        except ValueError:
            continue
        if v != default:
            return v
    raise AssertionError(f"no other value for {name}")


def text_of(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_setting_keeps_its_name_and_lives_in_one_group_field():
    assert {n: (s.group + "." if s.group else "") + s.field for n, s in SPECS.items()} == WHERE
    assert all(s.env == "PHASEWISE_" + n.upper() for n, s in SPECS.items())
    # a group's prefix + the field's name, unless the field names itself
    for name, spec in SPECS.items():
        if spec.group is not None and name != GROUPS[spec.group].PREFIX + spec.field:
            assert GROUPS[spec.group].PREFIX == "" and name.endswith(spec.field), name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_setting_from_the_environment_or_a_flag_lands_in_its_group_field_alone(name):
    value = other_value(name)
    base = Settings()
    for s in (Settings.from_env(env={SPECS[name].env: text_of(value)}),
              Settings.from_env({name: value}, env={}), base.replace(**{name: value})):
        assert read(s, WHERE[name]) == value and s.get(name) == value
        changed = {k for k, v in s.flat().items() if v != base.get(k)}
        assert changed == {name}


def test_flat_names_round_trip_and_describe_lists_every_setting_once():
    names = ("vpa_time_scale", "worker_hosts", "cgroup_root", "mem_margin_bytes",
             "phase_pretrained")
    s = Settings.from_env({name: other_value(name) for name in names}, env={})
    assert Settings.from_env(s.flat(), env={}) == s == Settings().replace(**s.flat())
    assert list(s.flat()) == list(SPECS)
    text = s.describe()
    assert text.startswith("settings: ")
    words = text[len("settings: "):].split(" ")
    named = [w.split("=", 1)[0] for w in words if "=" in w]
    assert [n for n in named if n in SPECS] == list(SPECS)
    assert f"vpa_time_scale={s.vpa.time_scale!r}" in words
    assert f"worker_hosts={s.worker.hosts!r}" in words


def test_defaults_are_the_declared_ones():
    s = Settings()
    for name, spec in SPECS.items():
        assert s.get(name) == Settings.default(name), name
        if spec.default is dataclasses.MISSING:
            assert spec.factory is not None
    assert Settings.default("phase_ratio_cap") == PhaseSettings().ratio_cap == 1.5
    assert Settings.default("mem_margin_bytes") == 64 * 2**20


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_group_refuses_a_value_of_the_wrong_type_naming_the_setting(name):
    spec = SPECS[name]
    cls = GROUPS[spec.group] if spec.group else Settings
    wrong = 1 if spec.kind == "str" else "1"
    with pytest.raises(SettingsError) as e:
        cls(**{spec.field: wrong})
    assert e.value.setting == name and "\n" not in str(e.value)


def test_groups_check_their_fields_and_the_rules_between_them():
    with pytest.raises(SettingsError, match=r"^vpa_time_scale: must be > 0, got 0$"):
        VpaSettings(time_scale=0)
    with pytest.raises(SettingsError, match=r"^worker_id: must not be empty$"):
        WorkerSettings(id=" ")
    with pytest.raises(SettingsError, match=r"^hysteresis: must be a finite number, got nan$"):
        WorkerSettings(hysteresis=math.nan)
    with pytest.raises(SettingsError, match=r"^heartbeat_interval_ms: must be below "
                                            r"session_timeout_ms \(6000\), got 6000$"):
        KafkaSettings(heartbeat_interval_ms=6000)
    ok = KafkaSettings(heartbeat_interval_ms=6000, session_timeout_ms=6001)
    assert ok.heartbeat_interval_ms == 6000
    with pytest.raises(SettingsError, match="^PHASEWISE_HEARTBEAT_INTERVAL_MS: must be below"):
        Settings.from_env(env={"PHASEWISE_SESSION_TIMEOUT_MS": "1000",
                               "PHASEWISE_HEARTBEAT_INTERVAL_MS": "1000"})
    with pytest.raises(SettingsError, match=r"^host: must not be empty$"):
        Settings(host="")
    with pytest.raises(SettingsError, match=r"^vpa: must be a VpaSettings"):
        Settings(vpa=KafkaSettings())  # type: ignore[arg-type]


def test_groups_are_frozen_and_slotted():
    s = Settings()
    for group in (s, *(getattr(s, g) for g in GROUPS)):
        assert not hasattr(group, "__dict__")
        field = dataclasses.fields(group)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(group, field, getattr(group, field))


def test_replace_and_from_env_take_only_setting_names_and_check_the_values():
    s = Settings(host="h")
    with pytest.raises(SettingsError, match=r"^time_scale: unknown setting$"):
        s.replace(time_scale=2.0)
    with pytest.raises(SettingsError, match=r"^vpa: unknown setting$"):
        Settings.from_env({"vpa": VpaSettings()}, env={})
    with pytest.raises(SettingsError, match=r"^hysteresis: must be in \[0, 1\), got 1.0$"):
        s.replace(hysteresis=1.0)
    t = s.replace(vpa_time_scale=0.001, worker_id="w2", host="g")
    assert (t.vpa.time_scale, t.worker.id, t.host) == (0.001, "w2", "g")
    assert t.vpa.min_cpu_cores == s.vpa.min_cpu_cores
    # s itself is unchanged
    assert (s.vpa.time_scale, s.worker.id, s.host) == (1.0, "phasewise-worker", "h")
    assert t.kafka is s.kafka  # groups without a change are shared


def test_group_helpers():
    assert WorkerSettings(hosts=" a, b,,").host_set() == frozenset({"a", "b"})
    assert WorkerSettings().host_set() == frozenset()
    assert PhaseSettings(features="gpu, mem,cpu").feature_tuple() == ("cpu", "mem", "gpu")
    assert KafkaSettings(bootstrap="k:1").common() == {"bootstrap.servers": "k:1"}


def test_job_env_refuses_the_secrets_and_files_of_every_group():
    """``job_env`` (the actuator's group) knows the other groups' secrets and file settings."""
    for name in ("PHASEWISE_KAFKA_SASL_PASSWORD", "PHASEWISE_SIGNING_KEY_FILE", "PHASEWISE_JOB_SUBMITTER_KEY_FILE"):
        with pytest.raises(SettingsError, match=f"^job_env: {name} is a secret"):
            Settings().replace(job_env=f"{name}=x")
    assert Settings().replace(job_env="PHASEWISE_HOST=h").actuator.job_env == "PHASEWISE_HOST=h"
