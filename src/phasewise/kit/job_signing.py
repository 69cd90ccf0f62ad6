"""Ed25519 submitter signatures on jobs: who may have a command started, and the trusted keys.

``phasewise submit`` signs, the agents carry the signature into the starting decision, the actuator
checks it against ``job_trusted_submitters`` (docs/security.md, "Who may start a job": what is
signed, key ids, key files, rotation). Pure crypto and files, no Kafka.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os
import stat
import struct
from collections.abc import Iterable

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from phasewise.kit.records import JobEvent, JobSpec, SchemaError, from_dict, to_dict

__all__ = ["PREFIX", "START_FIELDS", "JobSigningError", "SubmitterKeys", "generate_key", "key_id",
           "load_private_key", "load_public_key", "sign_event", "sign_job", "signed_message", "spec_digest",
           "spec_of", "start_details", "trusted_submitters", "write_key_pair"]

#: the scheme a job signature starts with
PREFIX = "ed25519"
_DOMAIN = b"phasewise-job-v1"
#: a key file is short; a larger one is a mistake (or an attack on the reader)
_MAX_KEY_FILE = 1 << 16


class JobSigningError(ValueError):
    """A key file or key set that cannot be used; ``str(e)`` is one line naming the setting or path."""


# --------------------------------------------------------------------------- keys


def generate_key() -> Ed25519PrivateKey:
    """A new submitter key."""
    return Ed25519PrivateKey.generate()


def key_id(public_key: Ed25519PublicKey) -> str:
    """8 hex digits naming *public_key*: the sha256 of its 32 raw bytes (not secret)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:8]


def _public_text(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def write_key_pair(path: str) -> str:
    """Write a new key to *path* (PKCS#8 PEM, mode 0600) and its public key to *path*.pub; its key id.

    Refuses (:class:`JobSigningError`) when either file exists: a key is never overwritten.
    """
    pub_path = path + ".pub"
    for p in (path, pub_path):
        if os.path.lexists(p):
            raise JobSigningError(f"{p} exists: a key file is never overwritten (remove it, or choose another path)")
    key = generate_key()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    written: list[str] = []
    try:
        for p, data, mode in ((path, private, 0o600), (pub_path, _public_text(key.public_key()), 0o644)):
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
            written.append(p)
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), mode)  # whatever the umask
                fh.write(data)
    except OSError as e:
        for p in written:
            os.unlink(p)
        raise JobSigningError(f"cannot write {e.filename or path}: {e.strerror or e}") from None
    return key_id(key.public_key())


def _read_small(path: str, what: str) -> tuple[bytes, os.stat_result]:
    try:  # (non-blocking: a FIFO in a key's place does not hang the role)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise JobSigningError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JobSigningError(f"{what}: {path} is not a regular file")
        if st.st_size > _MAX_KEY_FILE:
            raise JobSigningError(f"{what}: {path} is {st.st_size} bytes; a key file is short")
        chunks, left = [], _MAX_KEY_FILE + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), st
    except OSError as e:
        raise JobSigningError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def load_private_key(path: str, setting: str = "job_submitter_key_file") -> Ed25519PrivateKey:
    """The submitter key in *path*; :class:`JobSigningError` naming *setting* (one line) otherwise."""
    data, st = _read_small(path, setting)
    if st.st_mode & 0o077:
        raise JobSigningError(f"{setting}: {path} is readable or writable by group or others "
                              f"(mode {st.st_mode & 0o777:o}); chmod 600 it")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise JobSigningError(f"{setting}: {path} is encrypted; a submitter key file is unencrypted PEM "
                              f"(protect it by its mode)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise JobSigningError(f"{setting}: {path} is not a PEM private key "
                              f"(make one with: phasewise keys submitter {path})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise JobSigningError(f"{setting}: {path} holds a {type(key).__name__.removeprefix('_')}, "
                              f"not an Ed25519 key (make one with: phasewise keys submitter PATH)")
    return key


def load_public_key(path: str, setting: str = "job_trusted_submitters") -> Ed25519PublicKey:
    """The public key in *path* (PEM or an OpenSSH ``ssh-ed25519`` line); :class:`JobSigningError` otherwise."""
    data, st = _read_small(path, setting)
    if st.st_mode & 0o022:
        raise JobSigningError(f"{setting}: {path} is writable by group or others (mode {st.st_mode & 0o777:o}): "
                              f"whoever can write it can add a submitter; chmod 644 it")
    try:
        if data.lstrip().startswith(b"ssh-"):
            key = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise JobSigningError(f"{setting}: {path} is not a public key (PEM, or an ssh-ed25519 line)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise JobSigningError(f"{setting}: {path} holds a {type(key).__name__.removeprefix('_')}, "
                              f"not an Ed25519 public key")
    return key


# --------------------------------------------------------------------------- what is signed


def spec_digest(spec: JobSpec) -> str:
    """sha256 hex of the canonical JSON of *spec* as the schema normalises it (:func:`~phasewise.kit.records.to_dict`).

    >>> from phasewise.kit.records import JobRequests
    >>> a = JobSpec(model="m", dataset="d", batch_size=1, requests=JobRequests(cpu_cores=2))
    >>> b = from_dict(JobSpec, {"model": "m", "dataset": "d", "batch_size": 1.0, "requests": {"cpu_cores": 2.0},
    ...                         "unknown": 1})
    >>> spec_digest(a) == spec_digest(b)
    True
    """
    # through the schema once more: a spec built in Python may hold an int where the schema reads a float
    normal = to_dict(from_dict(JobSpec, to_dict(spec)))
    if normal.get("service") is None:  # (added later: a spec without one keeps the digest it had before)
        normal.pop("service", None)
    text = json.dumps(normal, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _part(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def signed_message(job: str, ts: float, workload: str, priority: int, digest: str) -> bytes:
    """The bytes a job signature covers (each field length-prefixed after the domain)."""
    return _DOMAIN + b"".join(_part(x.encode()) for x in (job, repr(float(ts)), workload, str(int(priority)),
                                                          digest))


def sign_job(private_key: Ed25519PrivateKey, job: str, ts: float, workload: str, priority: int,
             spec: JobSpec) -> str:
    """``ed25519:<key id>:<base64 signature>`` over the job's id, time, workload, priority and spec digest."""
    sig = private_key.sign(signed_message(job, ts, workload, priority, spec_digest(spec)))
    return f"{PREFIX}:{key_id(private_key.public_key())}:{base64.b64encode(sig).decode()}"


def sign_event(private_key: Ed25519PrivateKey, event: JobEvent) -> JobEvent:
    """*event* (kind ``submitted``, with a spec) with its :attr:`~phasewise.kit.records.JobEvent.signature` set."""
    if event.kind != "submitted" or event.spec is None:
        raise ValueError("only a submitted event with a spec is signed")
    return dataclasses.replace(event, signature=sign_job(private_key, event.job, event.ts, event.workload,
                                                         event.priority, event.spec))


# --------------------------------------------------------------------------- the trusted keys


@dataclasses.dataclass(frozen=True, slots=True)
class _Stamp:
    """What a trusted path looked like when it was read (a change means: read the set again)."""

    path: str
    mtime_ns: int
    ino: int
    size: int


def _stamp(path: str) -> _Stamp:
    st = os.stat(path)
    return _Stamp(path, st.st_mtime_ns, st.st_ino, st.st_size)


class SubmitterKeys:
    """The public keys whose jobs may be started, by key id.

    :meth:`load` reads them from ``job_trusted_submitters``'s paths (files, and
    directories of ``*.pub``); :meth:`refresh` reads them again when one of
    those changed, and fails closed: while the set cannot be read, every job is
    refused with the reason.

    >>> key = generate_key()
    >>> spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32, command=("python", "train.py"))
    >>> sig = sign_job(key, "j1", 1700000000.5, "training", 0, spec)
    >>> keys = SubmitterKeys.of([key.public_key()])
    >>> keys.verify("j1", 1700000000.5, "training", 0, spec, sig) is None
    True
    >>> keys.verify("j1", 1700000000.5, "training", 5, spec, sig)[:21]
    'wrong job signature: '
    """

    def __init__(self, keys: dict[str, Ed25519PublicKey], paths: tuple[str, ...] = (),
                 stamps: tuple[_Stamp, ...] = (), sources: dict[str, str] | None = None) -> None:
        self.keys = dict(keys)
        self.paths = paths
        self._stamps = stamps
        #: key id -> the file it came from
        self.sources = dict(sources or {})
        #: why the set could not be read again (``None``: it is current)
        self.error: str | None = None

    @classmethod
    def of(cls, public_keys: Iterable[Ed25519PublicKey]) -> SubmitterKeys:
        """A fixed set (tests, tools): never read again."""
        return cls({key_id(k): k for k in public_keys})

    @classmethod
    def load(cls, text: str, setting: str = "job_trusted_submitters") -> SubmitterKeys:
        """The keys of a comma list of files and directories; :class:`JobSigningError` (one line) otherwise."""
        paths = tuple(p.strip() for p in text.split(",") if p.strip())
        keys, stamps, sources = cls._read(paths, setting)
        return cls(keys, paths, stamps, sources)

    @staticmethod
    def _read(paths: tuple[str, ...], setting: str) -> tuple[dict, tuple[_Stamp, ...], dict]:
        keys: dict[str, Ed25519PublicKey] = {}
        sources: dict[str, str] = {}
        stamps: list[_Stamp] = []
        for path in paths:
            try:
                st = os.stat(path)
            except OSError as e:
                raise JobSigningError(f"{setting}: cannot read {path}: {e.strerror or e}") from None
            files = [path]
            if stat.S_ISDIR(st.st_mode):
                if st.st_mode & 0o022:
                    raise JobSigningError(f"{setting}: directory {path} is writable by group or others "
                                          f"(mode {st.st_mode & 0o777:o}): whoever can write it can add a "
                                          f"submitter; chmod 755 it")
                try:
                    names = sorted(n for n in os.listdir(path) if n.endswith(".pub") and not n.startswith("."))
                except OSError as e:
                    raise JobSigningError(f"{setting}: cannot list {path}: {e.strerror or e}") from None
                files = [os.path.join(path, n) for n in names]
            stamps.append(_Stamp(path, st.st_mtime_ns, st.st_ino, st.st_size))
            for f in files:
                k = load_public_key(f, setting)
                try:
                    stamps.append(_stamp(f))
                except OSError as e:
                    raise JobSigningError(f"{setting}: cannot read {f}: {e.strerror or e}") from None
                kid = key_id(k)
                keys[kid] = k
                sources.setdefault(kid, f)
        return keys, tuple(stamps), sources

    def refresh(self, setting: str = "job_trusted_submitters") -> bool:
        """Read the set again if a path named in it (or a file found in a directory) changed; whether it did.

        A set that cannot be read holds no key until it can (:attr:`error` says why).
        """
        if not self.paths:
            return False
        try:
            now = []
            for s in self._stamps:
                now.append(_stamp(s.path))
            changed = tuple(now) != self._stamps or any(
                stat.S_ISDIR(os.stat(p).st_mode) and self._listing_changed(p) for p in self.paths)
        except OSError:
            changed = True
        if not changed and self.error is None:
            return False
        try:
            self.keys, self._stamps, self.sources = self._read(self.paths, setting)
            self.error = None
        except JobSigningError as e:
            self.keys, self.sources, self.error = {}, {}, str(e)
        return True

    def _listing_changed(self, path: str) -> bool:
        known = {s.path for s in self._stamps}
        names = (os.path.join(path, n) for n in os.listdir(path) if n.endswith(".pub") and not n.startswith("."))
        return any(n not in known for n in names)

    def __len__(self) -> int:
        return len(self.keys)

    def describe(self) -> str:
        """The trusted key ids and their files, for a start-up line."""
        if not self.keys:
            return "none"
        return ", ".join(f"{kid} ({self.sources[kid]})" if kid in self.sources else kid
                         for kid in sorted(self.keys))

    def verify_digest(self, job: str, ts: float, workload: str, priority: int, digest: str,
                      signature: str | None) -> str | None:
        """Why *signature* does not prove a trusted submitter signed this job (``None``: it does)."""
        if self.error is not None:
            return f"the trusted submitters cannot be read ({self.error}); no job is started until they can"
        if not signature:
            return ("the job is not signed by a submitter (no job signature): sign it with phasewise submit "
                    "--key (or job_submitter_key_file)")
        try:
            scheme, kid, b64 = signature.split(":")
            raw = base64.b64decode(b64, validate=True)
        except (ValueError, binascii.Error):
            return "malformed job signature (expected ed25519:<key id>:<base64>)"
        if scheme != PREFIX:
            return f"job signature of unknown scheme {scheme[:16]!r} (expected {PREFIX})"
        key = self.keys.get(kid)
        if key is None:
            trusted = ", ".join(sorted(self.keys)) or "none"
            return f"signed by submitter key {kid[:16]!r}, which is not trusted (job_trusted_submitters: {trusted})"
        try:
            key.verify(raw, signed_message(job, ts, workload, priority, digest))
        except InvalidSignature:
            return (f"wrong job signature: the job, its time, workload, priority or spec changed after key "
                    f"{kid} signed it")
        return None

    def verify(self, job: str, ts: float, workload: str, priority: int, spec: JobSpec,
               signature: str | None) -> str | None:
        """Why *signature* is not a trusted submitter's over this job and *spec* (``None``: it is)."""
        return self.verify_digest(job, ts, workload, priority, spec_digest(spec), signature)

    def verify_event(self, event: JobEvent) -> str | None:
        """:meth:`verify` of a ``submitted`` event."""
        if event.spec is None:
            return "the job event carries no spec"
        return self.verify(event.job, event.ts, event.workload, event.priority, event.spec, event.signature)


#: what a decision that starts a job carries of its submitted event (``details``), for the actuator to verify
START_FIELDS = ("job", "job_ts", "workload", "priority", "spec", "spec_digest", "job_signature")


def start_details(event: JobEvent) -> dict:
    """The :data:`START_FIELDS` of a ``submitted`` *event*, JSON-ready, for a decision's ``details``.

    Copied from the event as submitted (its priority, not a later one; its
    signature, or ``None``): the actuator verifies them and runs the spec's
    command, nothing an agent wrote.
    """
    if event.spec is None:
        raise ValueError(f"job {event.job!r}: a submitted event without a spec starts nothing")
    return {"job": event.job, "job_ts": event.ts, "workload": event.workload, "priority": event.priority,
            "spec": to_dict(event.spec), "spec_digest": spec_digest(event.spec), "job_signature": event.signature}


def trusted_submitters(text: str, setting: str = "job_trusted_submitters") -> SubmitterKeys | None:
    """The keys *text* (``job_trusted_submitters``) names, ``None`` when it is empty; :class:`JobSigningError`
    (one line) when they cannot be read or there is none."""
    if not text.strip():
        return None
    keys = SubmitterKeys.load(text, setting)
    if not keys:
        raise JobSigningError(f"{setting}: no public key in {text} (a directory's keys are its *.pub files)")
    return keys


def spec_of(data: object) -> JobSpec:
    """The :class:`JobSpec` of a decoded JSON object (a decision's ``details.spec``); :class:`ValueError` why not."""
    try:
        return from_dict(JobSpec, data)  # type: ignore[arg-type]
    except SchemaError as e:
        raise ValueError(str(e)) from None
