"""The configuration reference: ``python -m phasewise.kit.settings`` (what ``make schemas`` runs) prints it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from phasewise.kit.settings import reference

REPO = Path(__file__).resolve().parents[3]


def test_the_module_prints_the_reference_the_makefile_writes():
    assert "python -m phasewise.kit.settings > docs/configuration.md" in (REPO / "Makefile").read_text()
    out = subprocess.run([sys.executable, "-m", "phasewise.kit.settings"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out == reference() == (REPO / "docs" / "configuration.md").read_text()
