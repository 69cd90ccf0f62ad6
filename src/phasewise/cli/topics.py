"""``phasewise topics``: create phasewise's topics idempotently and list them (docs/operations.md, "Topics").

Exit status 0 when every topic exists; 1, with one line saying why, when no broker answered within
``--timeout`` seconds or the cluster refused a topic.
"""

from __future__ import annotations

import argparse
import logging
import sys

from phasewise.kit.command import add_common, add_setting, arg_type, settings_from_args
from phasewise.kit.settings import above, parse_float
from phasewise.kit.topics import TOPICS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    add_setting(p, "topic_partitions", help="override every topic's partition count (0 = documented per topic)")
    p.add_argument("--timeout", type=arg_type(parse_float, above(0)), default=30.0, metavar="SECONDS",
                   help="give up when no broker answers within this long (default 30)")


def run(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException

    from phasewise.kit.kafka.client import BrokerUnavailable, ensure_topics

    s = settings_from_args(args)
    if s.log_level != "debug":  # the one line below says it; no running commentary while waiting
        logging.getLogger("phasewise.kafka.client").setLevel(logging.ERROR)
    try:
        created = ensure_topics(s, timeout_s=args.timeout)
    except BrokerUnavailable as e:
        print(f"phasewise topics: {e}", file=sys.stderr)
        return 1
    except KafkaException as e:
        err = e.args[0] if e.args else e
        print(f"phasewise topics: the cluster refused: {getattr(err, 'str', lambda: err)()}", file=sys.stderr)
        return 1
    for t in TOPICS:
        mark = "created" if t.name in created else "exists "
        print(f"{mark} {t.name:28s} key={t.key:11s} "
              f"partitions={s.kafka.topic_partitions or t.partitions}"
              f"{' compacted' if t.compacted else ''}  {t.doc}")
    return 0
