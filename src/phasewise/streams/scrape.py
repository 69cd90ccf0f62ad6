"""A small Prometheus scrape client for the autoscaler agent: GET a replica's metrics endpoint and read its
latency histogram, request count and CPU counter from the text exposition format (prometheus_client's parser).

:func:`parse` is pure (text in, :class:`~phasewise.models.jobs.autoscaler.Scrape` out, a
:class:`ScrapeError` naming what is wrong otherwise); :func:`fetch` does the HTTP, bounded in time and
size; :func:`scrape_target` scrapes every URL of one service. docs/priorities.md, "Inference autoscaling".
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from phasewise.models.jobs.autoscaler import Scrape, Target

__all__ = ["MAX_BYTES", "ScrapeError", "fetch", "parse", "scrape_target"]

#: the largest exposition read from one endpoint (a service's is a few KiB)
MAX_BYTES = 4 * 2**20


class ScrapeError(ValueError):
    """An endpoint that gave no usable metrics: ``str(e)`` says why, in one line."""


def parse(text: str, t: float, latency_metric: str, cpu_metric: str) -> Scrape:
    """The :class:`Scrape` of one exposition read at *t*.

    The histogram's buckets are summed over its other labels (method, path, ...) by ``le``; its
    ``_count`` likewise. Absent metrics are empty (no buckets, ``None``): an endpoint may serve only
    some. A text that is not the exposition format, a bucket without a numeric ``le`` or a negative
    or non-finite count raise :class:`ScrapeError`.
    """
    buckets: dict[float, float] = {}
    count: float | None = None
    cpu: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == f"{latency_metric}_bucket":
                    try:
                        le = float(s.labels["le"])
                    except (KeyError, ValueError):
                        raise ScrapeError(f"{s.name} has a bucket without a numeric le label: "
                                          f"{dict(s.labels)!r}"[:300]) from None
                    buckets[le] = buckets.get(le, 0.0) + _count(s.name, s.value)
                elif s.name == f"{latency_metric}_count":
                    count = (count or 0.0) + _count(s.name, s.value)
                elif s.name == cpu_metric:
                    cpu = (cpu or 0.0) + _count(s.name, s.value)
    except ScrapeError:
        raise
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise ScrapeError(f"not the Prometheus text format: {type(e).__name__}: {e}"[:300]) from None
    if buckets and not any(math.isinf(le) for le in buckets):
        raise ScrapeError(f"{latency_metric}_bucket has no le=\"+Inf\" bucket")
    ordered = tuple(sorted(buckets.items()))
    for (_, a), (le, b) in zip(ordered, ordered[1:], strict=False):
        if b < a:
            raise ScrapeError(f"{latency_metric}_bucket is not cumulative (le={le:g} holds {b:g} < {a:g})")
    return Scrape(t=t, buckets=ordered, count=count, cpu_seconds=cpu)


def _count(name: str, v: float) -> float:
    if not (math.isfinite(v) and v >= 0):
        raise ScrapeError(f"{name} is {v!r}, not a finite count >= 0")
    return float(v)


def fetch(url: str, timeout_s: float, max_bytes: int = MAX_BYTES) -> str:
    """The body of ``GET url`` (HTTP 200, at most *max_bytes*, UTF-8); :class:`ScrapeError` otherwise."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - http(s) URLs of the spec only
            if r.status != 200:
                raise ScrapeError(f"{url}: HTTP {r.status}")
            body = r.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ScrapeError(f"{url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ScrapeError(f"{url}: {getattr(e, 'reason', e)}") from None
    if len(body) > max_bytes:
        raise ScrapeError(f"{url}: more than {max_bytes} bytes")
    try:
        return body.decode()
    except UnicodeDecodeError:
        raise ScrapeError(f"{url}: not UTF-8") from None


def scrape_target(target: Target, timeout_s: float, clock: Callable[[], float],
                  on_error: Callable[[str, str], None] | None = None) -> dict[str, Scrape | None]:
    """Each of *target*'s URLs scraped now: its :class:`Scrape`, or ``None`` (*on_error(url, why)* says why)."""
    out: dict[str, Scrape | None] = {}
    for url in target.urls:
        try:
            text = fetch(url, timeout_s)
            out[url] = parse(text, clock(), target.latency_metric, target.cpu_metric)
        except ScrapeError as e:
            out[url] = None
            if on_error is not None:
                on_error(url, str(e))
    return out
