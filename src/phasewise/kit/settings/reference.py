"""docs/configuration.md, written from the settings' declarations (``python -m phasewise.kit.settings``).

A test keeps the page current (tests/test_readme.py).
"""

from __future__ import annotations

import dataclasses

from phasewise.kit.settings.process import GROUPS, SPECS
from phasewise.kit.settings.spec import format_size, parse_size

__all__ = ["default_text", "reference"]

def default_text(name: str) -> str:
    """A setting's default as a user would write it (``64Mi``, ``hostname``)."""
    spec = SPECS[name]
    if spec.default is dataclasses.MISSING:
        return {"host": "hostname",
                "data_dir": "/var/lib/phasewise as root, else $XDG_STATE_HOME/phasewise or ~/.local/state/phasewise",
                }.get(name, "computed")
    if spec.parse is parse_size:
        return format_size(spec.default)
    if isinstance(spec.default, bool):
        return str(spec.default).lower()
    return str(spec.default) if spec.default != "" else "(empty)"


def reference() -> str:
    """``docs/configuration.md``: every setting by group, with its variable, flag, default and meaning.

    Written from the declarations, so each default and check stays written once
    (``python -m phasewise.kit.settings > docs/configuration.md``; a test keeps the file current).
    """
    lines = [
        "# Configuration",
        "",
        "<!-- written by `python -m phasewise.kit.settings > docs/configuration.md`; a test keeps it current -->",
        "",
        "Every setting is read from its `PHASEWISE_<NAME>` environment variable and, where a role has one,",
        "its flag; a flag wins over the environment, which wins over the default. The environment takes the",
        "flags' forms: sizes as `67108864`, `64Mi` or `1G` (`Mi`/`Gi` binary, `M`/`G` decimal), booleans as",
        "`true`/`false`, `yes`/`no`, `on`/`off`, `1`/`0`; `nan` and `inf` are refused. A refused value stops",
        "the role with one line, `phasewise ROLE: error: <setting>: <why>`, and exit status 2; an unknown",
        "`PHASEWISE_*` variable gets a warning naming the closest setting. Each role prints the settings it",
        "runs with at start-up.",
        "",
    ]

    def section(title: str, doc: str, names: list[str]) -> None:
        lines.extend([f"## {title}", "", doc, "",
                      "| variable | flag | default | meaning |", "|---|---|---|---|"])
        for name in names:
            spec = SPECS[name]
            meaning = spec.help + (f" (one of: {', '.join(spec.choices)})" if spec.choices else "")
            lines.append(f"| `{spec.env}` | {f'`{spec.flag}`' if spec.flag else ''} | `{default_text(name)}` | "
                         f"{meaning} |")
        lines.append("")

    top = [n for n, sp in SPECS.items() if sp.group is None]
    section("Every role", "Read by every role.", top)
    for attr, cls in GROUPS.items():
        doc = " ".join((cls.__doc__ or "").split())
        section(f"`{attr}`", doc, [n for n, sp in SPECS.items() if sp.group == attr])
    return "\n".join(lines).rstrip() + "\n"
