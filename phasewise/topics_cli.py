"""``phasewise topics``: create phasewise's topics idempotently and list them."""

from __future__ import annotations

import argparse

from phasewise.cli import add_common, settings_from_args
from phasewise.topics import TOPICS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--partitions", dest="topic_partitions", type=int,
                   help="override every topic's partition count (default: documented per topic)")


def run(args: argparse.Namespace) -> int:
    from phasewise.kafka import ensure_topics

    s = settings_from_args(args)
    created = ensure_topics(s)
    for t in TOPICS:
        mark = "created" if t.name in created else "exists "
        print(f"{mark} {t.name:28s} key={t.key:11s} partitions={s.topic_partitions or t.partitions}"
              f"{' compacted' if t.compacted else ''}  {t.doc}")
    return 0
