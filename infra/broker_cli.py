"""``phasewise broker``: the embedded Tansu broker in the foreground."""

from __future__ import annotations

import argparse
import signal

from phasewise.infra.broker import EmbeddedBroker


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=9092, help="loopback port (default 9092)")
    p.add_argument("--no-topics", action="store_true", help="do not create phasewise's topics")
    p.add_argument("--log-level", dest="log_level", default=None)


def run(args: argparse.Namespace) -> int:
    from phasewise.kafka import ensure_topics
    from phasewise.settings import Settings

    b = EmbeddedBroker(args.port).start()
    try:
        if not args.no_topics:
            ensure_topics(Settings.from_env({"bootstrap": b.bootstrap}))
        print(f"embedded broker (Tansu, memory storage) on {b.bootstrap}; "
              f"clients: --bootstrap {b.bootstrap} or PHASEWISE_BOOTSTRAP={b.bootstrap}", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        return b.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        b.stop()
