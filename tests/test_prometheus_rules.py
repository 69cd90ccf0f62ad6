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
from phasewise.streams.metrics import WorkerMetrics

RULES = Path(__file__).resolve().parents[1] / "infra" / "prometheus"
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not installed (Debian package 'prometheus'; `make tools` installs it)"
)


def exported_names() -> set[str]:
    names: set[str] = set()
    for cls in (ProducerMetrics, WorkerMetrics, ActuatorMetrics):
        reg = CollectorRegistry()
        cls(reg)
        for fam in reg.collect():
            names.update(s.name for s in fam.samples)
    return names


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
