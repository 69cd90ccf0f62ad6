"""The README stays true about configuration."""

from pathlib import Path

from phasewise.settings import SPECS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_setting_is_documented_in_the_readme():
    missing = [name for name in SPECS if f"| `{name}` |" not in README]
    assert not missing, f"README configuration table lacks: {missing}"


def test_the_readme_names_both_setup_commands():
    assert "make demo" in README and "make test" in README
