"""The alert rules: valid for promtool, their unit tests pass, and every metric they use is exported."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.producers.metrics import ProducerMetrics
from phasewise.streams.metrics import HorusMetrics, PlacementMetrics, WorkerMetrics

RULES = Path(__file__).resolve().parents[1] / "infra" / "prometheus"
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not installed (Debian package 'prometheus'; `make tools` installs it)"
)


SUFFIXES = {"counter": ("_total",), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def exported_names() -> set[str]:
    """Series names the roles export, including labelled metrics whose first series appears later.

    A labelled metric with no child yet (``phasewise_worker_delivery_errors_total{topic}``
    before its first error) has a family but no sample, so names come from the family type too.
    """
    names: set[str] = set()
    for cls in (ProducerMetrics, WorkerMetrics, ActuatorMetrics, HorusMetrics, PlacementMetrics):
        reg = CollectorRegistry()
        cls(reg)
        for fam in reg.collect():
            names.update(s.name for s in fam.samples)
            names.update(fam.name + suffix for suffix in SUFFIXES.get(fam.type, ()))
    return names


def test_a_labelled_metric_without_series_yet_still_counts_as_exported():
    assert "phasewise_worker_delivery_errors_total" in exported_names()
    assert "phasewise_worker_not_a_metric_total" not in exported_names()


def test_every_metric_an_alert_uses_is_exported_by_a_role():
    text = (RULES / "phasewise-rules.yml").read_text()
    used = set(re.findall(r"\b(phasewise_[a-z_]+)", text))
    assert used, "the rules use no phasewise metric"
    missing = used - exported_names()
    assert not missing, f"rules reference metrics no role exports: {sorted(missing)}"


@needs_promtool
def test_promtool_accepts_the_rules():
    r = subprocess.run([promtool, "check", "rules", "phasewise-rules.yml"], cwd=RULES,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_the_rules_fire_and_resolve_as_their_unit_tests_say():
    r = subprocess.run([promtool, "test", "rules", "phasewise-rules.test.yml"], cwd=RULES,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- every alert: tested, documented

yaml = pytest.importorskip("yaml")
RUNBOOKS = Path(__file__).resolve().parents[1] / "docs" / "runbooks.md"


def alerts() -> dict[str, dict]:
    doc = yaml.safe_load((RULES / "phasewise-rules.yml").read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_every_alert_has_a_unit_test_that_sees_it_fire_and_one_that_sees_it_quiet():
    tests = yaml.safe_load((RULES / "phasewise-rules.test.yml").read_text())["tests"]
    fires, quiet = set(), set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = set(alerts())
    assert len(names) >= 14
    assert names - fires == set(), f"alerts no promtool test sees firing: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts no promtool test sees quiet: {sorted(names - quiet)}"


def test_every_alert_links_its_runbook_section():
    sections = set(re.findall(r"^## (\w+)$", RUNBOOKS.read_text(), flags=re.M))
    for name, rule in alerts().items():
        assert name in sections, f"docs/runbooks.md has no section for {name}"
        assert rule["annotations"]["runbook_url"] == f"docs/runbooks.md#{name.lower()}", name
    assert sections - set(alerts()) == set(), "runbook sections for alerts that do not exist"


def test_no_rule_needs_the_workaround_for_series_born_at_one():
    text = (RULES / "phasewise-rules.yml").read_text()
    assert "unless phasewise_worker_delivery_errors_total offset" not in text
