"""HMAC-SHA256 signatures on the decisions and model snapshots the worker publishes (:class:`Keyring`).

A verifier refuses what is unsigned or wrongly signed when a key is configured; what is signed, key
ids, rotation and what a signature does not prove: docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["HEADER", "MIN_KEY_BYTES", "Keyring", "SigningError", "header_of", "key_id", "keyring_of", "read_key"]

#: the Kafka header that carries a record's signature
HEADER = "phasewise-hmac"
#: a key file holds at least this many bytes of secret (HMAC-SHA256's block-sized key is 64)
MIN_KEY_BYTES = 32
_DOMAIN = b"phasewise-hmac-v1"


class SigningError(ValueError):
    """A key file that cannot be used; ``str(e)`` is one line naming the setting."""


def read_key(path: str, setting: str) -> bytes:
    """The key in *path* (surrounding whitespace stripped); :class:`SigningError` naming *setting* otherwise."""
    try:
        st = os.stat(path)
        if st.st_size > 1 << 16:
            raise SigningError(f"{setting}: {path} is {st.st_size} bytes; a key file holds a short secret")
        with open(path, "rb") as fh:
            key = fh.read().strip()
    except OSError as e:
        raise SigningError(f"{setting}: cannot read {path}: {e.strerror or e}") from None
    if len(key) < MIN_KEY_BYTES:
        raise SigningError(f"{setting}: {path} holds {len(key)} bytes; a key needs at least {MIN_KEY_BYTES} "
                           f"(e.g. head -c 48 /dev/urandom | base64 > {path})")
    if st.st_mode & 0o077:
        raise SigningError(f"{setting}: {path} is readable by group or others (mode {st.st_mode & 0o777:o}); "
                           f"chmod 600 it")
    return key


def key_id(key: bytes) -> str:
    """8 hex digits naming *key* (not secret: a hash of it)."""
    return hashlib.sha256(b"phasewise-key-id\0" + key).hexdigest()[:8]


def _mac(key: bytes, topic: str, record_key: bytes | None, value: bytes | None) -> str:
    t = topic.encode()
    k = b"" if record_key is None else record_key
    v = b"" if value is None else value
    msg = b"".join((_DOMAIN, struct.pack(">I", len(t)), t, struct.pack(">I", len(k)), k,
                    struct.pack(">Q", len(v)), v))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def header_of(headers: Any) -> bytes | None:
    """The :data:`HEADER` value among Kafka *headers* (a list of pairs or a dict; ``None``: absent)."""
    if not headers:
        return None
    items: Iterable = headers.items() if isinstance(headers, dict) else headers
    for name, value in items:
        if name == HEADER:
            return value if isinstance(value, bytes) else (value.encode() if isinstance(value, str) else None)
    return None


class Keyring:
    """The key this process signs with and the keys it accepts (the previous one until *previous_until*).

    >>> ring = Keyring(b"k" * 32)
    >>> h = ring.sign("phasewise.decisions.v1", b"host-a", b'{"v":1}')
    >>> ring.verify("phasewise.decisions.v1", b"host-a", b'{"v":1}', [(HEADER, h)], now=0.0) is None
    True
    >>> ring.verify("phasewise.decisions.v1", b"host-a", b'{"v":2}', [(HEADER, h)], now=0.0)
    'wrong signature (phasewise-hmac): the record was changed or signed with another key'
    >>> ring.verify("phasewise.decisions.v1", b"host-a", b'{"v":1}', None, now=0.0)
    'unsigned: no phasewise-hmac header, and signing_key_file is set'
    """

    def __init__(self, key: bytes, previous: bytes | None = None, previous_until: float = 0.0) -> None:
        if len(key) < MIN_KEY_BYTES or (previous is not None and len(previous) < MIN_KEY_BYTES):
            raise SigningError(f"a signing key needs at least {MIN_KEY_BYTES} bytes")
        self.key, self.previous, self.previous_until = key, previous, float(previous_until)
        self.id = key_id(key)
        self.previous_id = None if previous is None else key_id(previous)

    def sign(self, topic: str, record_key: bytes | None, value: bytes | None) -> bytes:
        """The :data:`HEADER` value for a record of *topic*."""
        return f"v1:{self.id}:{_mac(self.key, topic, record_key, value)}".encode()

    def headers(self, topic: str, record_key: bytes | None, value: bytes | None) -> list[tuple[str, bytes]]:
        """Kafka headers carrying the record's signature."""
        return [(HEADER, self.sign(topic, record_key, value))]

    def verify(self, topic: str, record_key: bytes | None, value: bytes | None, headers: Any,
               now: float | None = None) -> str | None:
        """Why the record is refused (``None``: signed with an accepted key)."""
        raw = header_of(headers)
        if raw is None:
            return f"unsigned: no {HEADER} header, and signing_key_file is set"
        try:
            version, kid, mac = raw.decode("ascii").split(":")
        except (UnicodeDecodeError, ValueError):
            return f"malformed {HEADER} header (expected v1:<key id>:<hex>)"
        if version != "v1":
            return f"{HEADER} header of unknown version {version[:16]!r}"
        if kid == self.id:
            key = self.key
        elif kid == self.previous_id:
            now = time.time() if now is None else now
            if now > self.previous_until:
                return (f"signed with the previous key {kid}, accepted only until "
                        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(self.previous_until))} "
                        f"(signing_previous_key_until)")
            key = self.previous  # type: ignore[assignment]
        else:
            return f"signed with an unknown key {kid[:16]!r} (this process accepts {self._accepted()})"
        if not hmac.compare_digest(mac.encode("ascii"), _mac(key, topic, record_key, value).encode()):
            return f"wrong signature ({HEADER}): the record was changed or signed with another key"
        return None

    def _accepted(self) -> str:
        return self.id + (f" and, until {self.previous_until:.0f}, {self.previous_id}" if self.previous_id else "")


def keyring_of(settings: Any) -> Keyring | None:
    """The keyring the ``signing_*`` settings name (``None``: no key configured); :class:`SigningError`."""
    s = settings.signing
    if not s.key_file:
        if s.previous_key_file:
            raise SigningError("signing_previous_key_file: set without signing_key_file")
        return None
    key = read_key(s.key_file, "signing_key_file")
    previous = None
    if s.previous_key_file:
        if not s.previous_key_until:
            raise SigningError("signing_previous_key_until: must be set (Unix time) with "
                               "signing_previous_key_file")
        previous = read_key(s.previous_key_file, "signing_previous_key_file")
    return Keyring(key, previous, s.previous_key_until)
