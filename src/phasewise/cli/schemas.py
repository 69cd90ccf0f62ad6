"""``phasewise schemas``: generate or check the topics' JSON Schemas (and ``phasewise replay --json``'s)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from phasewise.kit.records import RECORDS, json_schemas
from phasewise.kit.records.replay_output import SCHEMA_NAME, replay_output_schema


def render() -> dict[str, str]:
    schemas = {**json_schemas(RECORDS), SCHEMA_NAME: replay_output_schema()}
    return {name: json.dumps(s, indent=2, sort_keys=True) + "\n" for name, s in schemas.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="DIR", help="write one <Record>.v<N>.json per record into DIR")
    g.add_argument("--check", metavar="DIR", help="exit 1 if DIR is not current")


def run(args: argparse.Namespace) -> int:
    files = render()
    if args.write:
        d = Path(args.write)
        try:
            d.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (d / name).write_text(text)
        except OSError as e:
            print(f"phasewise schemas: error: --write: {e.strerror or e}: {e.filename or d}", file=sys.stderr)
            return 2
        print(f"wrote {len(files)} schemas to {d}")
        return 0
    d = Path(args.check)
    stale = [n for n, t in files.items() if not (d / n).exists() or (d / n).read_text() != t]
    if stale:
        print("stale JSON Schemas (run `make schemas`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(f"{len(files)} schemas current in {d}")
    return 0
