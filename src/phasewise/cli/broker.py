"""``phasewise broker``: the embedded Tansu broker in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys

from phasewise.kit.broker import BrokerError, EmbeddedBroker
from phasewise.kit.command import arg_type
from phasewise.kit.settings import in_range, parse_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.command import add_setting

    p.add_argument("--port", type=arg_type(parse_int, in_range(1, 65535)), default=9092,
                   help="loopback port (default 9092)")
    p.add_argument("--no-topics", action="store_true", help="do not create phasewise's topics")
    add_setting(p, "log_level")


def run(args: argparse.Namespace) -> int:
    from phasewise.kit.kafka.client import BrokerUnavailable, ensure_topics
    from phasewise.kit.settings import Settings

    b = EmbeddedBroker(args.port)
    try:
        b.start()
        if not args.no_topics:
            ensure_topics(Settings.from_env({"bootstrap": b.bootstrap}))
        print(f"embedded broker (Tansu, memory storage) on {b.bootstrap}; "
              f"clients: --bootstrap {b.bootstrap} or PHASEWISE_BOOTSTRAP={b.bootstrap}", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        return b.wait()
    except (BrokerError, BrokerUnavailable) as e:
        print(f"phasewise broker: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        b.stop()
