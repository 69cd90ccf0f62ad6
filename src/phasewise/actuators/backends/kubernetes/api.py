"""A small JSON client for the Kubernetes API server, and which pod of this node holds a container.

:class:`KubeApi` is the standard library's ``urllib`` with the service
account's bearer token (re-read for every request) and CA bundle;
:class:`PodDirectory` finds a managed container's pod by its runtime id
among this node's pods (docs/kubernetes.md, "The Kubernetes backend").
"""

from __future__ import annotations

import json
import math
import os
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CONTAINER_ID", "SA_DIR", "ApiError", "KubeApi", "PodContainer", "PodDirectory", "path_resolver"]

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_TEMPORARY_STATUS = {409, 429, 500, 502, 503, 504}


class ApiError(Exception):
    """A failed API request: the HTTP status (0: no answer), the Status reason and message."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}" if status else message)
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s

    @property
    def temporary(self) -> bool:
        return self.status == 0 or self.status in _TEMPORARY_STATUS


class KubeApi:
    """A small JSON client for the API server: bearer token, CA bundle, timeouts.

    *token_file* is re-read for every request (the kubelet rotates bound
    service-account tokens); *ca_file* verifies the server (``https`` only).
    """

    def __init__(self, base_url: str, *, token: str | None = None, token_file: str | Path | None = None,
                 ca_file: str | Path | None = None, timeout_s: float = 10.0) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"API server URL must be http(s)://host[:port], got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._token, self._token_file = token, Path(token_file) if token_file else None
        self.timeout_s = timeout_s
        self._ssl: ssl.SSLContext | None = None
        if u.scheme == "https":
            self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)

    @classmethod
    def in_cluster(cls, sa_dir: Path = SA_DIR, env: dict[str, str] | None = None, timeout_s: float = 10.0) -> KubeApi:
        """The API server as a pod sees it: ``KUBERNETES_SERVICE_HOST/PORT``, the service account's token and CA."""
        env = dict(os.environ) if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("not in a cluster: KUBERNETES_SERVICE_HOST is not set")
        token, ca = sa_dir / "token", sa_dir / "ca.crt"
        for f in (token, ca):
            if not f.is_file():
                raise ValueError(f"not in a cluster: {f} is missing (is a service account mounted?)")
        netloc = f"[{host}]" if ":" in host else host
        return cls(f"https://{netloc}:{port}", token_file=token, ca_file=ca, timeout_s=timeout_s)

    def _bearer(self) -> str | None:
        if self._token_file is not None:
            return self._token_file.read_text().strip()
        return self._token

    def _open(self, method: str, path: str, timeout_s: float, data: bytes | None = None,
              content_type: str = "application/json") -> Any:
        """The answer to one request, open (the caller reads and closes it); :class:`ApiError` for an error
        answer, an unreadable token or no answer."""
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            tok = self._bearer()
        except OSError as e:
            raise ApiError(0, "TokenUnreadable", f"cannot read the service account token: {e}") from e
        if tok:
            req.add_header("Authorization", f"Bearer {tok}")
        try:
            return urllib.request.urlopen(req, timeout=timeout_s, context=self._ssl)
        except urllib.error.HTTPError as e:
            raise _api_error(e.code, e.read(), e.headers.get("Retry-After")) from None
        except (urllib.error.URLError, OSError) as e:
            raise ApiError(0, "Unreachable", f"{method} {path}: {getattr(e, 'reason', e)}") from e

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        """Send one request; the decoded JSON answer, or :class:`ApiError`."""
        data = None if body is None else json.dumps(body).encode()
        resp = self._open(method, path, self.timeout_s, data, content_type)
        try:
            with resp:
                raw = resp.read()
        except OSError as e:  # a timeout or a reset while the answer came
            raise ApiError(0, "Unreachable", f"{method} {path}: {e}") from e
        try:
            return json.loads(raw) if raw else None
        except ValueError as e:
            raise ApiError(0, "BadAnswer", f"{method} {path}: answer is not JSON") from e

    def stream(self, path: str, *, read_timeout_s: float) -> Iterator[Any]:
        """A watch: the decoded JSON of each line the server sends (``watch=true`` answers one JSON object
        per line, chunked), until it ends the answer; :class:`ApiError` for an error answer."""
        resp = self._open("GET", path, read_timeout_s)
        with resp:
            while True:
                try:
                    line = resp.readline()
                except (OSError, ValueError) as e:  # a timeout, a reset, a broken chunk
                    raise ApiError(0, "Unreachable", f"watch {path}: {e}") from e
                if not line:
                    return
                line = line.strip()
                if not line:
                    continue
                try:
                    yield json.loads(line)
                except ValueError as e:
                    raise ApiError(0, "BadAnswer", f"watch {path}: a line is not JSON") from e


def _api_error(code: int, raw: bytes, retry_after: str | None) -> ApiError:
    reason, message = "", raw[:200].decode("utf-8", "replace")
    try:
        st = json.loads(raw)
        if isinstance(st, dict) and st.get("kind") == "Status":
            reason, message = str(st.get("reason") or ""), str(st.get("message") or "")
    except ValueError:
        pass
    try:
        ra = float(retry_after) if retry_after else None
    except ValueError:
        ra = None
    return ApiError(code, reason, message, ra)



# --------------------------------------------------------------------------- which pod holds a container


@dataclass(frozen=True)
class PodContainer:
    namespace: str
    pod: str
    container: str


#: the runtime's container id in a managed name
CONTAINER_ID = re.compile(r"([0-9a-f]{64})")


class PodDirectory:
    """Finds the pod and container of a managed container name among this node's pods.

    The name holds the runtime's container id (``cri-containerd-<id>.scope``,
    ``crio-<id>.scope``, ``docker-<id>.scope``, ``<id>``), matched against
    ``status.containerStatuses[].containerID`` (``<runtime>://<id>``). The
    node's pod list is cached for *ttl_s*; a miss refreshes it when the list
    is older than *miss_refresh_s* (a new pod), so unknown names do not
    hammer the API server.
    """

    def __init__(self, api: KubeApi, node: str, *, ttl_s: float = 10.0, miss_refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not node:
            raise ValueError("the node name is needed (set it from the downward API: spec.nodeName)")
        self.api, self.node, self.ttl_s, self._clock = api, node, ttl_s, clock
        self.miss_refresh_s = miss_refresh_s
        self._by_id: dict[str, PodContainer] = {}
        self._at = -math.inf

    def _refresh(self) -> None:
        sel = urllib.parse.quote(f"spec.nodeName={self.node}")
        # resourceVersion=0: served from the API server's watch cache, not a quorum read of etcd (every
        # node lists every few seconds)
        pods = self.api.request("GET", f"/api/v1/pods?fieldSelector={sel}&resourceVersion=0")
        by_id = {}
        for p in (pods or {}).get("items") or []:
            md = p.get("metadata") or {}
            st = p.get("status") or {}
            for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
                cid = str(cs.get("containerID") or "").partition("://")[2]
                if cid:
                    by_id[cid] = PodContainer(md.get("namespace", "default"), md.get("name", ""), cs.get("name", ""))
        self._by_id, self._at = by_id, self._clock()

    def __call__(self, managed_name: str) -> PodContainer | None:
        m = CONTAINER_ID.search(managed_name)
        if m is None:
            return None
        cid = m.group(1)
        age = self._clock() - self._at
        if age > self.ttl_s or (cid not in self._by_id and age > self.miss_refresh_s):
            self._refresh()
        return self._by_id.get(cid)


def path_resolver(managed_name: str) -> PodContainer | None:
    """``namespace/pod/container`` (or ``namespace.pod.container`` where a ``/`` is not allowed).

    >>> path_resolver("ml/trainer-0/worker")
    PodContainer(namespace='ml', pod='trainer-0', container='worker')
    """
    parts = managed_name.split("/") if "/" in managed_name else managed_name.split(".")
    return PodContainer(*parts) if len(parts) == 3 and all(parts) else None

