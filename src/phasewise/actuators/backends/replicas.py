"""Local inference replicas: real processes in their own cgroups behind one loopback endpoint.

A service is a placed inference job whose signed spec has a ``service`` section with a ``port`` P.
Replica 1 is the placed job itself, in its container C, started with ``PORT=P+1``; replica k > 1 is the
same signed command in its own container ``C@rk`` (a sibling cgroup: its own limits, freezer, OOM
accounting; the first replica's CPU weight), started through the cgroup backend exactly as a placed job
(as ``job_user``, no new privileges, an environment built from scratch) with ``PORT=P+k``. The service's one endpoint,
127.0.0.1:P, is a TCP balancer (:class:`Balancer`, a thread running an asyncio server) that hands each
new connection to the next replica in turn, skipping one that refuses. :class:`LocalReplicas` carries
out :class:`~phasewise.actuators.commands.ScaleReplicas`: it starts the missing replicas, stops the
extra ones (SIGTERM, SIGKILL after the grace; their containers removed) and points the balancer at
those running. Which replicas run is read from the cgroups each time (after an actuator restart too);
the endpoints it serves are kept in ``<data_dir>/replica-services.json`` and opened again at start-up.
docs/priorities.md, "Inference autoscaling".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from phasewise.actuators.backends.cgroup import CgroupBackend, weight_of_shares
from phasewise.actuators.commands import Outcome, ScaleReplicas, SetCpuWeight, Terminate
from phasewise.kit.cgroups.fs import CgroupError

__all__ = ["Balancer", "LocalReplicas", "replica_container"]

log = logging.getLogger(__name__)

#: bytes copied per read between a client and a replica
CHUNK = 64 * 2**10


def replica_container(container: str, k: int) -> str:
    """Replica *k*'s container: the service's own for the first, ``<container>@r<k>`` for the others.

    >>> replica_container("svc", 1), replica_container("svc", 3)
    ('svc', 'svc@r3')
    """
    return container if k == 1 else f"{container}@r{k}"


class Balancer:
    """127.0.0.1:*port* -> the replicas' ports on loopback, a new connection to the next one in turn.

    A thread runs an asyncio server; :meth:`set_ports` changes the replicas at any time (connections open
    stay where they are). A connection no replica accepts is closed. :meth:`close` stops it.
    """

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.port, self.host = port, host
        self.ports: tuple[int, ...] = ()
        self._next = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        started = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(
                    asyncio.start_server(self._serve, host, port, reuse_address=True, backlog=256))
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                error.append(e)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"phasewise-balancer-{port}", daemon=True)
        self._thread.start()
        started.wait()
        if error:
            self._loop.close()
            raise OSError(f"cannot listen on {host}:{port}: {error[0]}")

    def set_ports(self, ports: list[int] | tuple[int, ...]) -> None:
        self.ports = tuple(ports)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        ports = self.ports
        upstream = None
        for i in range(len(ports)):
            p = ports[(self._next + i) % len(ports)]
            try:
                upstream = await asyncio.open_connection(self.host, p)
                self._next = (self._next + i + 1) % max(1, len(ports))
                break
            except OSError:
                continue
        if upstream is None:
            writer.close()
            return
        up_r, up_w = upstream
        await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer), return_exceptions=True)
        for w in (writer, up_w):
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                w.close()

    def close(self) -> None:
        def stop() -> None:
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        if self._loop.is_running():
            self._loop.call_soon_threadsafe(stop)
            self._thread.join(5)
        with contextlib.suppress(RuntimeError):
            self._loop.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if dst.can_write_eof():
                dst.write_eof()
            else:
                dst.close()


class LocalReplicas:
    """Carries out :class:`ScaleReplicas` through a :class:`CgroupBackend` that starts jobs.

    *on_start(container, job, pid)* and *on_stop(container)* enter each replica's container in the
    actuator's registry, under its own name as its job (a replica's end is not its service's). *state_file*: where the
    endpoints served are kept across restarts (``None``: nowhere).
    """

    def __init__(self, backend: CgroupBackend, *, state_file: Path | None = None,
                 on_start: Callable[[str, str, int | None], None] | None = None,
                 on_stop: Callable[[str], None] | None = None) -> None:
        self.backend = backend
        self.name = backend.name
        self.state_file = state_file
        self.on_start = on_start or (lambda c, j, p: None)
        self.on_stop = on_stop or (lambda c: None)
        #: service container -> (port, its balancer)
        self.balancers: dict[str, Balancer] = {}
        #: the replica containers (k > 1) started here and not seen to end: their end is no job's state
        self.names: set[str] = set()
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ which replicas run

    def is_replica(self, container: str) -> bool:
        """Whether *container* is a replica k > 1 of a service this actuator runs."""
        return container in self.names

    def _running(self, container: str) -> bool:
        try:
            return self.backend.exists(container) and bool(self.backend._pids(container))
        except (OSError, CgroupError, ValueError):
            return False

    def running(self, container: str, port: int, upto: int = 64) -> list[int]:
        """The replicas (their k) of the service in *container* that hold a process now."""
        return [k for k in range(1, upto + 1) if self._running(replica_container(container, k))]

    # ------------------------------------------------------------------ the endpoint

    def serve(self, container: str, port: int) -> Balancer:
        """The balancer of the service in *container* at 127.0.0.1:*port*, opened if it is not (pointed at the
        replicas running now)."""
        with self.lock:
            b = self.balancers.get(container)
            if b is not None and b.port != port:
                b.close()
                b = None
            if b is None:
                b = self.balancers[container] = Balancer(port)
                self._save()
                log.info("service %s: endpoint 127.0.0.1:%d open", container, port)
            b.set_ports([port + k for k in self.running(container, port)])
            return b

    def forget(self, container: str) -> None:
        """Close the endpoint of the service in *container* (it ended)."""
        with self.lock:
            b = self.balancers.pop(container, None)
            if b is not None:
                b.close()
                self._save()

    def reopen(self) -> int:
        """At start-up: open again the endpoints of the services whose first replica still runs; how many."""
        if self.state_file is None or not self.state_file.exists():
            return 0
        try:
            saved = json.loads(self.state_file.read_text())
            items = [(str(c), int(p)) for c, p in saved.items()]
        except (OSError, ValueError, AttributeError, TypeError) as e:
            log.error("cannot read %s (%s): service endpoints are opened again at their next scale decision",
                      self.state_file, e)
            return 0
        n = 0
        for c, port in items:
            if not self._running(c):
                continue
            try:
                b = self.serve(c, port)
                self.names.update(replica_container(c, k) for k in self.running(c, b.port) if k > 1)
                n += 1
            except OSError as e:
                log.error("service %s: %s", c, e)
        with self.lock:
            self._save()
        return n

    def _save(self) -> None:
        if self.state_file is None:
            return
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({c: b.port for c, b in sorted(self.balancers.items())}))
        os.replace(tmp, self.state_file)

    def ended(self, container: str, grace_s: float) -> str | None:
        """The service in *container* ended (its first replica exited or was terminated): stop its other
        replicas and close its endpoint; what was done (``None``: it is no service served here)."""
        with self.lock:
            b = self.balancers.get(container)
        if b is None:
            return None
        b.set_ports(())
        stopped = []
        for k in self.running(container, b.port):
            if k == 1:
                continue
            name = replica_container(container, k)
            out = self.backend.apply(Terminate(name, grace_s))
            with contextlib.suppress(OSError, CgroupError):
                self._remove(name)
            self.on_stop(name)
            stopped.append(f"replica {k} {out.status}")
        self.forget(container)
        return f"endpoint 127.0.0.1:{b.port} closed" + (f", {', '.join(stopped)}" if stopped else "")

    def close(self) -> None:
        with self.lock:
            for b in self.balancers.values():
                b.close()
            self.balancers.clear()

    # ------------------------------------------------------------------ the command

    def exists(self, container: str) -> bool:
        return self.backend.exists(container)

    def apply(self, cmd: ScaleReplicas) -> Outcome:
        if not isinstance(cmd, ScaleReplicas):
            return Outcome.failed(f"the replicas backend carries out scale commands only, not {cmd!r}")
        c, port = cmd.container, cmd.port
        if not self._running(c):
            return Outcome.failed(f"service {c!r}: its first replica (the placed job) is not running: not scaled")
        try:
            balancer = self.serve(c, port)
        except OSError as e:
            return Outcome.failed(f"service {c!r}: {e}")
        before = self.running(c, port)
        said: list[str] = []
        try:
            cpus = self._cpuset(c)
        except (OSError, CgroupError) as e:
            return Outcome.failed(f"service {c!r}: cannot read its cpuset: {e}", temporary=True)
        for k in range(2, cmd.replicas + 1):  # the missing ones
            if k in before:
                continue
            name = replica_container(c, k)
            if self.backend.exists(name):  # an earlier replica k that ended: its empty container goes first
                self._remove(name)
            start = dataclasses.replace(cmd.start, container=name, cpus=cpus, resume=False,
                                        env=(*cmd.start.env, ("PORT", str(port + k))))
            out = self.backend.apply(start)
            if out.status != "applied":
                ks = self._point(balancer, c, port)
                return Outcome.failed(f"service {c!r}: replica {k} did not start: {out.message}"
                                      + (f" ({'; '.join(said)})" if said else ""), temporary=out.temporary,
                                      replicas=len(ks))
            self.names.add(name)
            self.on_start(name, name, out.pid)
            said.append(f"replica {k} pid {out.pid} on port {port + k}" + self._same_weight(c, name))
        stopping = sorted((k for k in before if k > cmd.replicas), reverse=True)
        if stopping:  # out of the balancer first: new connections go to the ones that stay
            balancer.set_ports([port + k for k in before if k <= cmd.replicas])
        for k in stopping:
            name = replica_container(c, k)
            out = self.backend.apply(Terminate(name, cmd.grace_s))
            if out.status != "applied":
                ks = self._point(balancer, c, port)
                return Outcome.failed(f"service {c!r}: replica {k} did not stop: {out.message}", replicas=len(ks))
            try:
                self._remove(name)
            except (OSError, CgroupError) as e:
                log.warning("service %s: replica %d's container not removed: %s", c, k, e)
            self.on_stop(name)
            said.append(f"replica {k} stopped")
        now = self._point(balancer, c, port)
        what = "; ".join(said) if said else "no change"
        return Outcome.applied(f"service {c}: {len(now)} replica(s) {now} behind 127.0.0.1:{port} ({what})",
                               replicas=len(now))

    def _same_weight(self, container: str, name: str) -> str:
        """Give replica *name* the CPU weight of the first replica in *container* (its priority's, when an
        agent weighted it); what was done, for the actuation's message."""
        layout = self.backend.layout
        try:
            d = layout.path(container, "cpu")
            if layout.version == 1:
                weight = round(weight_of_shares(int((d / "cpu.shares").read_text())))
            else:
                weight = int((d / "cpu.weight").read_text())
        except (OSError, ValueError, CgroupError):
            return ""
        out = self.backend.apply(SetCpuWeight(name, weight))
        return f", cpu weight {weight}" if out.status == "applied" else f", cpu weight not set: {out.message}"

    def _point(self, balancer: Balancer, container: str, port: int) -> list[int]:
        ks = self.running(container, port)
        balancer.set_ports([port + k for k in ks])
        return ks

    def _remove(self, name: str) -> None:
        """A stopped replica's cgroups (and, in v1, its cpuset slice the backend made)."""
        why = self.backend.remove_container(name, timeout_s=5.0)
        if why is not None:
            raise CgroupError(why)

    def _cpuset(self, container: str) -> str:
        """The first replica's cpuset (every replica runs where the placement put the service)."""
        layout = self.backend.layout
        d = layout.path(container, "cpuset") if layout.version == 1 else layout.path(container)
        return (d / "cpuset.cpus").read_text().strip()
