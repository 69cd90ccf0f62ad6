"""Submitter keys for tests: a fixed trusted key, an untrusted one, and signed start details.

The keys are fixed bytes (no randomness between runs); :func:`start` is what
an agent copies from a signed ``submitted`` event into a place decision.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from phasewise.kit.job_signing import SubmitterKeys, sign_event, start_details
from phasewise.kit.records import JobEvent, JobRequests, JobSpec

#: the submitter the tests' actuators trust
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
#: a submitter nobody trusts
STRANGER = Ed25519PrivateKey.from_private_bytes(bytes(range(100, 132)))
TRUSTED = SubmitterKeys.of([KEY.public_key()])


def spec(command=("/bin/true",), **kw) -> JobSpec:
    kw.setdefault("requests", JobRequests())
    return JobSpec(model="resnet18", dataset="cifar10", batch_size=8, command=tuple(command), **kw)


def submitted(job: str, command=("/bin/true",), *, ts: float | None = None, priority: int = 0,
              workload: str = "training", key: Ed25519PrivateKey | None = KEY, host: str | None = None,
              **spec_kw) -> JobEvent:
    """A ``submitted`` event, signed with *key* (``None``: unsigned)."""
    ev = JobEvent(job=job, ts=time.time() if ts is None else ts, kind="submitted", priority=priority,
                  workload=workload, host=host, spec=spec(command, **spec_kw))
    return ev if key is None else sign_event(key, ev)


def start(job: str, command=("/bin/true",), **kw) -> dict:
    """The start details of a signed submission of *job* (see :func:`submitted`)."""
    return start_details(submitted(job, command, **kw))


def write_private(path: Path, key: Ed25519PrivateKey = KEY) -> Path:
    """*key* as a submitter key file (mode 0600)."""
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)
    return path


def write_public(path: Path, key: Ed25519PrivateKey = KEY) -> Path:
    """*key*'s public key as a ``.pub`` file (mode 0644)."""
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    os.chmod(path, 0o644)
    return path
