"""The README and the configuration reference stay true."""

from pathlib import Path

from phasewise.kit.settings import SPECS, reference

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CONFIGURATION = REPO / "docs" / "configuration.md"


def test_the_configuration_reference_is_written_from_the_settings_declarations():
    assert CONFIGURATION.read_text() == reference(), (
        "docs/configuration.md is stale: python -m phasewise.kit.settings > docs/configuration.md")
    text = CONFIGURATION.read_text()
    assert all(f"`{spec.env}`" in text for spec in SPECS.values())


def test_the_readme_names_both_setup_commands_and_links_the_references():
    assert "make demo" in README and "make test" in README
    for doc in ("docs/configuration.md", "docs/architecture.md"):
        assert doc in README and (REPO / doc).exists()
