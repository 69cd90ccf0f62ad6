"""phasewise managing real Docker containers (cgroup v1, cgroupfs driver).

A private ``dockerd`` (overlay2 storage where overlayfs mounts, else vfs; no
bridge, no iptables, cgroupfs driver, its own ``--cgroup-parent``) runs a
busybox container that spins one core. Docker puts it at
``/sys/fs/cgroup/<controller>/<parent>/<container id>``, which is phasewise's
layout with ``PHASEWISE_CGROUP_PREFIX=<parent>`` (on a Docker host: ``docker``). The test drives the real roles:

- ``phasewise produce --once`` reports the container by its Docker id, with
  its CPU use;
- decisions on the decisions topic -> ``phasewise actuate --backend cgroup``
  -> the container's own cgroup files (read from inside the container with
  ``docker exec``) hold the limits, the container is throttled to its CPU
  limit, and freeze / thaw stop and resume it.

Needs root, ``dockerd`` and a static busybox (Debian ``docker.io`` and
``busybox-static``; ``make tools`` installs them when it can), otherwise
skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from phasewise.kit.kafka.client import make_consumer, make_producer
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import Actuation, Decision, HostSamples, SchemaError, decode, encode
from phasewise.kit.topics import ACTUATIONS, DECISIONS
from tests.conftest import requires_root

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
DOCKERD = shutil.which("dockerd")
DOCKER = shutil.which("docker")

pytestmark = [
    requires_root,
    pytest.mark.slow,
    pytest.mark.skipif(not (DOCKERD and DOCKER), reason="dockerd/docker not installed (Debian docker.io)"),
    pytest.mark.skipif(not os.access(BUSYBOX, os.X_OK), reason="no static busybox for the test image"),
    pytest.mark.skipif(not Path("/sys/fs/cgroup/cpu").is_dir(), reason="needs the cgroup v1 cpu hierarchy"),
]

IMAGE = "phasewise-test-busybox:1"
SPIN = "while :; do :; done"


class Dockerd:
    """A private Docker daemon; ``docker(*args)`` runs the CLI against it."""

    def __init__(self, parent: str) -> None:
        # short paths: containerd's unix sockets live under exec-root (108-byte limit)
        self.dir = Path(tempfile.mkdtemp(prefix="pwdk", dir="/tmp"))
        self.sock = self.dir / "docker.sock"
        self.parent = parent
        self.log = self.dir / "dockerd.log"
        self.proc: subprocess.Popen | None = None

    def storage_driver(self) -> str:
        """overlay2 where overlayfs mounts in this directory (a layer is then a diff, not vfs's full copy of the
        image: the image builds spend minutes copying with vfs), else vfs, which works anywhere."""
        probe = self.dir / "overlay-probe"
        for sub in ("lower", "upper", "work", "merged"):
            (probe / sub).mkdir(parents=True)
        r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={probe}/lower,upperdir={probe}/upper,workdir={probe}/work",
                            str(probe / "merged")], capture_output=True)
        if r.returncode == 0:
            subprocess.run(["umount", str(probe / "merged")], capture_output=True)
        shutil.rmtree(probe, ignore_errors=True)
        return "overlay2" if r.returncode == 0 else "vfs"

    def start(self, timeout: float = 60.0) -> Dockerd:
        cmd = [DOCKERD, f"--storage-driver={self.storage_driver()}", "--iptables=false", "--bridge=none",
               "--exec-opt", "native.cgroupdriver=cgroupfs",
               # a leading "/": under the hierarchies' roots, not under dockerd's own cgroup
               "--cgroup-parent", "/" + self.parent,
               "--data-root", str(self.dir / "root"), "--exec-root", str(self.dir / "x"),
               "--pidfile", str(self.dir / "dockerd.pid"), "-H", f"unix://{self.sock}"]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("dockerd exited:\n" + self.log.read_text()[-3000:])
            if self.sock.exists() and self.docker("version", check=False).returncode == 0:
                return self
            time.sleep(0.3)
        raise RuntimeError(f"dockerd did not answer within {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def docker(self, *args: str, check: bool = True, input: bytes | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run([DOCKER, "-H", f"unix://{self.sock}", *args], input=input, capture_output=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed: {r.stderr.decode()[-2000:]}")
        return r

    def import_busybox(self) -> None:
        """``docker import`` of a root filesystem holding only a static busybox."""
        root = self.dir / "rootfs"
        (root / "bin").mkdir(parents=True)
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        for applet in ("sh", "cat", "sleep"):
            (root / "bin" / applet).symlink_to("busybox")
        tar = self.dir / "rootfs.tar"
        with tarfile.open(tar, "w") as t:
            t.add(root, arcname=".")
        self.docker("import", str(tar), IMAGE, timeout=120)

    def stop(self) -> None:
        if self.proc is None:
            return
        ids = self.docker("ps", "-aq", check=False).stdout.decode().split()
        if ids:
            self.docker("rm", "-f", *ids, check=False, timeout=60)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for ctrl in Path("/sys/fs/cgroup").iterdir():
            d = ctrl / self.parent
            if d.is_dir():
                for sub in d.iterdir():
                    if sub.is_dir():
                        try:
                            sub.rmdir()
                        except OSError:
                            pass
                try:
                    d.rmdir()
                except OSError:
                    pass
        # dockerd leaves its network namespace (and with overlay2 any layer still in use) mounted under its
        # directory
        for line in Path("/proc/mounts").read_text().splitlines():
            mnt = line.split()[1]
            if mnt.startswith(str(self.dir) + "/"):
                subprocess.run(["umount", "-l", mnt], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def dockerd():
    d = Dockerd(parent=f"pwdocker-{uuid.uuid4().hex[:8]}")
    try:
        d.start()
        d.import_busybox()
        yield d
    finally:
        d.stop()


@pytest.fixture
def spinner(dockerd):
    """A container spinning one core; yields its full Docker id."""
    name = f"spin-{uuid.uuid4().hex[:6]}"
    cid = dockerd.docker("run", "-d", "--name", name, IMAGE, "/bin/sh", "-c", SPIN).stdout.decode().strip()
    try:
        yield cid
    finally:
        dockerd.docker("rm", "-f", cid, check=False)


def sample_once(settings, prefix: str, tmp_path: Path) -> HostSamples:
    """One ``phasewise produce --once`` over the Docker containers."""
    env = {**os.environ, "PHASEWISE_CGROUP_PREFIX": prefix, "PHASEWISE_CGROUP_ROOT": "/sys/fs/cgroup",
           "PHASEWISE_HOST": settings.host, "PHASEWISE_INTERVAL_S": "1", "PHASEWISE_LOG_LEVEL": "warning"}
    r = RoleProcess("produce", ["--once"], env=env, log_path=tmp_path / f"once-{uuid.uuid4().hex[:4]}.log")
    r.start()
    assert r.proc is not None
    r.proc.wait(60)
    r.stop()
    assert r.proc.returncode == 0, r.log_tail()
    line = [ln for ln in r.log_path.read_text().splitlines() if ln.startswith("{")][-1]
    return decode(HostSamples, line)


def container_sample(hs: HostSamples, cid: str):
    got = [c for c in hs.containers if c.container == cid]
    assert got, f"container {cid[:12]} not in the sample: {[c.container[:12] for c in hs.containers]}"
    return got[0]


def test_the_host_agent_reports_a_docker_container_by_its_id(settings, dockerd, spinner, tmp_path):
    c = container_sample(sample_once(settings, dockerd.parent, tmp_path), spinner)
    assert len(c.container) == 64  # Docker's full id, as `docker inspect` names it
    # a spinning core (an idle container reads ~0): on a 2-core machine shared with the whole test run it gets
    # what the scheduler leaves it, 0.24 core in one loaded run
    assert c.cpu_cores > 0.05, c
    assert c.cpu_limit_cores is None and c.mem_limit_bytes is None  # docker run without limits


def test_the_actuator_limits_freezes_and_thaws_a_docker_container(settings, dockerd, spinner, tmp_path):
    # the actuator did not start this container: the operator's policy file says which job it is, so the job's
    # freeze and thaw decisions reach it (docs/security.md, "Which containers an actuator touches")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"workloads": [{"match": spinner, "job": spinner}]}))
    env = {"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_HOST": settings.host,
           "PHASEWISE_CGROUP_ROOT": "/sys/fs/cgroup", "PHASEWISE_CGROUP_PREFIX": dockerd.parent,
           "PHASEWISE_DATA_DIR": str(tmp_path / "actuator"), "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_WORKLOAD_POLICY_FILE": str(policy)}
    actuator = RoleProcess("actuate", ["--backend", "cgroup"], env=env, log_path=tmp_path / "actuator.log")
    producer = make_producer(settings, partitioner=PARTITIONER)  # as the worker: the host's partition
    consumer = make_consumer(settings, f"docker-{uuid.uuid4().hex[:6]}")
    consumer.subscribe([ACTUATIONS.name])
    seen: dict[str, Actuation] = {}

    def decide(action: str, **limits) -> str:
        d = Decision(id=uuid.uuid4().hex, ts=time.time(), host=settings.host, container=spinner, action=action,
                     policy="test", reason=f"docker test: {action}", **limits)
        producer.produce(DECISIONS.name, key=settings.host.encode(), value=encode(d))
        producer.flush(10)
        return d.id

    def outcome(decision_id: str, timeout: float = 60) -> Actuation:
        deadline = time.monotonic() + timeout
        while decision_id not in seen and time.monotonic() < deadline:
            assert actuator.alive(), actuator.log_tail()
            m = consumer.poll(0.5)
            if m is None or m.error():
                continue
            try:  # other tests share the topic
                a = decode(Actuation, m.value())
            except SchemaError:
                continue
            seen[a.decision_id] = a
        assert decision_id in seen, f"no actuation within {timeout:.0f} s\n{actuator.log_tail()}"
        return seen[decision_id]

    def inside(path: str) -> str:
        """A cgroup file as the container itself sees it."""
        return dockerd.docker("exec", spinner, "/bin/cat", path).stdout.decode().strip()

    try:
        actuator.start()
        # 1. CPU and memory limits
        a = outcome(decide("limit", cpu_limit_cores=0.2, mem_limit_bytes=128 * 2**20))
        assert a.status == "applied", a
        assert int(inside("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")) == 20_000
        assert int(inside("/sys/fs/cgroup/memory/memory.limit_in_bytes")) == 128 * 2**20
        host_dir = Path("/sys/fs/cgroup/cpu") / dockerd.parent / spinner
        assert int((host_dir / "cpu.cfs_quota_us").read_text()) == 20_000
        time.sleep(1.0)  # a full sampling interval under the new quota
        c = container_sample(sample_once(settings, dockerd.parent, tmp_path), spinner)
        assert c.cpu_limit_cores == pytest.approx(0.2)
        assert c.cpu_cores < 0.3, c  # held to its limit...
        # ...by CFS throttling. On a machine busy with the rest of the suite the spinner may get less than its
        # quota for a whole sampling second (0.06 core in one run): wait until a second it was throttled in,
        # and the sample reports it
        deadline = time.monotonic() + 90
        while c.throttled_periods == 0 and time.monotonic() < deadline:
            c = container_sample(sample_once(settings, dockerd.parent, tmp_path), spinner)
        assert c.throttled_periods > 0, c
        assert c.cpu_cores < 0.3, c
        # 2. freeze: the container's processes stop; thaw: they run again
        a = outcome(decide("freeze"))
        assert a.status == "applied", a
        freezer = Path("/sys/fs/cgroup/freezer") / dockerd.parent / spinner / "freezer.state"
        assert freezer.read_text().strip() == "FROZEN"
        c = container_sample(sample_once(settings, dockerd.parent, tmp_path), spinner)
        assert c.cpu_cores < 0.02, c
        a = outcome(decide("thaw"))
        assert a.status == "applied", a
        assert freezer.read_text().strip() == "THAWED"
        # running again: it uses CPU (frozen, it used none; how much it gets of its 0.2 depends on the machine's
        # load: 0.055 of a core in one sample of a loaded run)
        for _ in range(10):
            c = container_sample(sample_once(settings, dockerd.parent, tmp_path), spinner)
            if c.cpu_cores > 0.05:
                break
        assert c.cpu_cores > 0.05, c
        # Docker itself still reports the container running (phasewise worked below it)
        state = json.loads(dockerd.docker("inspect", spinner).stdout)[0]["State"]
        assert state["Running"] and not state["Paused"]
    finally:
        consumer.close()
        actuator.stop()


# --------------------------------------------------------------------------- the role images
REPO = Path(__file__).resolve().parents[1]
BASE_IMAGE = "phasewise-test-python:bookworm"
MIRROR = os.environ.get("PHASEWISE_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DOCKERFILE = REPO / "infra/docker/Dockerfile"


@pytest.fixture(scope="module")
def base_image(dockerd):
    """A minimal Debian bookworm with Python and the host's CA bundle, as the images' ``BASE``.

    No registry is reachable here, so the base is debootstrapped (package traffic may go
    through a TLS proxy, hence the host's CA bundle); ``pip`` inside the builds fetches each
    role's dependencies from the package index.
    """
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        pytest.skip("debootstrap not installed (Debian debootstrap; make tools installs it)")
    rootfs = dockerd.dir / "bookworm"
    r = subprocess.run([debootstrap, "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        "bookworm", str(rootfs), MIRROR], capture_output=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"debootstrap from {MIRROR} failed (no mirror?): {r.stdout.decode()[-500:]}")
    host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if host_ca.exists():
        shutil.copy2(host_ca, rootfs / "etc/ssl/certs/ca-certificates.crt")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imp = subprocess.run([DOCKER, "-H", f"unix://{dockerd.sock}", "import", "-", BASE_IMAGE], stdin=tar.stdout,
                         capture_output=True, timeout=600)
    tar.wait()
    assert imp.returncode == 0, imp.stderr.decode()
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_IMAGE


def build_image(dockerd, base: str, target: str, *build_args: str) -> str:
    """``infra/docker/Dockerfile``'s *target* on *base*; returns the image's tag."""
    tag = f"phasewise-{target}:test"
    args = [a for kv in (f"BASE={base}", *build_args) for a in ("--build-arg", kv)]
    build = dockerd.docker("build", "--network", "host", *args, "--target", target, "-f", str(DOCKERFILE),
                           "-t", tag, str(REPO), check=False, timeout=1500)
    assert build.returncode == 0, build.stdout.decode()[-3000:] + build.stderr.decode()[-3000:]
    return tag


@pytest.fixture(scope="module")
def actuator_image(dockerd, base_image):
    return build_image(dockerd, base_image, "actuator")


def http_status(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def wait_ready(dockerd, name: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    got = (0, "")
    while time.monotonic() < deadline:
        got = http_status(f"http://127.0.0.1:{port}/readyz")
        if got[0] == 200:
            return
        state = json.loads(dockerd.docker("inspect", name).stdout)[0]["State"]
        assert state["Running"], dockerd.docker("logs", name, check=False).stderr.decode()[-3000:]
        time.sleep(0.5)
    logs = dockerd.docker("logs", name, check=False)
    raise AssertionError(f"{name} not ready within {timeout_s:.0f} s: {got}\n"
                         + (logs.stdout + logs.stderr).decode()[-3000:])


def test_the_actuator_image_limits_a_container_from_inside_a_container_with_no_capability(
        settings, dockerd, actuator_image, spinner, tmp_path):
    from phasewise.kit.broker import free_port

    name = f"pw-actuator-{uuid.uuid4().hex[:6]}"
    port = free_port()
    dockerd.docker(
        # not --privileged and no capability at all: uid 0 (the cgroup files' owner) and a
        # read-write bind mount of the host's cgroup tree are all the actuator needs
        "run", "-d", "--name", name, "--network", "host", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--read-only", "--tmpfs", "/tmp",
        "-v", "/sys/fs/cgroup:/host/sys/fs/cgroup:rw", "-v", f"{tmp_path}:/var/lib/phasewise",
        "-e", f"PHASEWISE_BOOTSTRAP={settings.kafka.bootstrap}",
        "-e", f"PHASEWISE_HOST={settings.host}", "-e", "PHASEWISE_BIND_ADDRESS=127.0.0.1",
        "-e", f"PHASEWISE_METRICS_PORT={port}",
        "-e", f"PHASEWISE_CGROUP_PREFIX={dockerd.parent}", "-e", "PHASEWISE_LOG_LEVEL=info",
        actuator_image)
    producer = make_producer(settings, partitioner=PARTITIONER)  # as the worker: the host's partition
    consumer = make_consumer(settings, f"docker-img-{uuid.uuid4().hex[:6]}")
    consumer.subscribe([ACTUATIONS.name])
    try:
        wait_ready(dockerd, name, port, 60)
        d = Decision(id=uuid.uuid4().hex, ts=time.time(), host=settings.host, container=spinner, action="limit",
                     policy="test", reason="docker image test", cpu_limit_cores=0.3)
        producer.produce(DECISIONS.name, key=settings.host.encode(), value=encode(d))
        producer.flush(10)
        got = None
        deadline = time.monotonic() + 90
        while got is None and time.monotonic() < deadline:
            m = consumer.poll(0.5)
            if m is None or m.error():
                continue
            try:
                a = decode(Actuation, m.value())
            except SchemaError:
                continue
            if a.decision_id == d.id:
                got = a
        logs = dockerd.docker("logs", name, check=False)
        assert got is not None, "no actuation from the containerised actuator\n" + (
            logs.stdout + logs.stderr).decode()[-3000:]
        assert got.status == "applied", got
        host_dir = Path("/sys/fs/cgroup/cpu") / dockerd.parent / spinner
        assert int((host_dir / "cpu.cfs_quota_us").read_text()) == 30_000
        caps = dockerd.docker("exec", name, "grep", "CapEff", "/proc/1/status").stdout.decode().split()
        assert caps[-1] == "0000000000000000"  # really no capability
    finally:
        consumer.close()
        dockerd.docker("rm", "-f", name, check=False)


@pytest.fixture
def wheel_links():
    """The local directory of wheels (torch's CPU build) served on loopback for the worker's build."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    wheels = os.environ.get("PIP_FIND_LINKS", "/opt/wheels")
    if not list(Path(wheels).glob("torch-*.whl")):
        pytest.skip(f"no torch wheel in {wheels} to build the worker image from")

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=wheels))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    torch = sorted(Path(wheels).glob("torch-*.whl"))[-1].name.split("-")[1]
    yield f"http://127.0.0.1:{srv.server_address[1]}/", f"torch=={torch}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.skipif(os.environ.get("PHASEWISE_TEST_ALL_IMAGES") != "1",
                    reason="builds the worker image with torch (13 min on 2 cores with vfs storage): "
                           "run with PHASEWISE_TEST_ALL_IMAGES=1 (docs/deployment.md)")
def test_the_producer_and_worker_images_build_run_unprivileged_and_answer_their_probes(
        settings, dockerd, base_image, spinner, wheel_links, tmp_path):
    from phasewise.kit.broker import free_port

    links, torch = wheel_links
    producer_image = build_image(dockerd, base_image, "producer")
    worker_image = build_image(dockerd, base_image, "worker", f"TORCH_LINKS={links}", f"TORCH={torch}")
    env = ["-e", f"PHASEWISE_BOOTSTRAP={settings.kafka.bootstrap}", "-e", f"PHASEWISE_HOST={settings.host}",
           "-e", "PHASEWISE_BIND_ADDRESS=127.0.0.1", "-e", f"PHASEWISE_CGROUP_PREFIX={dockerd.parent}"]
    unprivileged = ["--network", "host", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only",
                    "--tmpfs", "/tmp"]
    ports = {"producer": free_port(), "worker": free_port()}
    names = {r: f"pw-{r}-{uuid.uuid4().hex[:6]}" for r in ports}
    try:
        dockerd.docker("run", "-d", "--name", names["producer"], *unprivileged, *env,
                       "-e", f"PHASEWISE_METRICS_PORT={ports['producer']}",
                       "-v", "/sys/fs/cgroup:/host/sys/fs/cgroup:ro", "-v", "/proc:/host/proc:ro", producer_image)
        dockerd.docker("run", "-d", "--name", names["worker"], *unprivileged, *env,
                       "--tmpfs", "/var/lib/phasewise:uid=65532,gid=65532,mode=0700",  # a tmpfs is 1777 unless told
                       "-e", f"PHASEWISE_METRICS_PORT={ports['worker']}",
                       "-e", f"PHASEWISE_WORKER_ID=pw-docker-{uuid.uuid4().hex[:6]}", worker_image)
        for role in ("producer", "worker"):
            wait_ready(dockerd, names[role], ports[role], 120)
            uid = dockerd.docker("exec", names[role], "id", "-u").stdout.decode().strip()
            assert uid == "65532", (role, uid)  # not root
        from phasewise.apps.bench.harness import scrape

        m = scrape(f"http://127.0.0.1:{ports['producer']}/metrics")
        assert m["phasewise_producer_containers"] >= 1  # the spinning container, seen from inside a container
        assert any(k.startswith("phasewise_build_info{") for k in scrape(f"http://127.0.0.1:{ports['worker']}/metrics"))
    finally:
        for n in names.values():
            dockerd.docker("rm", "-f", n, check=False)
