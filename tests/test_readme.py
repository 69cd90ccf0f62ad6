"""The README stays true about configuration."""

import dataclasses
from pathlib import Path

from phasewise.settings import Settings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_setting_is_documented_in_the_readme():
    missing = [f.name for f in dataclasses.fields(Settings) if f"| `{f.name}` |" not in README]
    assert not missing, f"README configuration table lacks: {missing}"


def test_the_readme_names_both_setup_commands():
    assert "make demo" in README and "make test" in README
