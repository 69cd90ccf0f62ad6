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


def test_the_operations_topic_table_lists_every_topic_as_declared():
    import re

    from phasewise.kit.topics import TOPICS

    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## Topics", 1)[1].split("\n## ", 1)[0]
    rows = {m[1]: (m[2], m[3], int(m[4]), m[5]) for m in re.finditer(
        r"^\| `([^`]+)`( \(compacted\))? \| ([^|]+?) \| (\d+) \| `(\w+)` \|$", section, re.M)}
    assert set(rows) == {t.name for t in TOPICS}, "docs/operations.md's topic table and kit/topics.py differ"
    for t in TOPICS:
        compacted, key, partitions, record = rows[t.name]
        assert (bool(compacted), key, partitions) == (t.compacted, t.key, t.partitions), t.name
        assert (REPO / "infra" / "schemas" / f"{record}.v1.json").exists(), record
