"""``phasewise explain [CONTAINER]``: a container's limits, each policy's recommendation, its phase, the
scorecard, read from the workers' ``/scorecard/`` view on their metrics port (without CONTAINER: the
containers each worker holds; CONTAINER is ``host/container`` or a unique container name).
Narrative: docs/worker.md, "The live scorecard".
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

__all__ = ["DEFAULT_WORKER", "add_arguments", "fetch", "format_card", "run"]

#: where ``explain`` looks without ``--worker``: the worker's metrics port in the images and manifests
DEFAULT_WORKER = "http://127.0.0.1:9107"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("container", nargs="?", help="host/container or a container name; none: list the containers")
    p.add_argument("--worker", action="append", metavar="URL",
                   help="a worker's metrics address (repeat for several workers; default "
                        f"{DEFAULT_WORKER}, the worker's metrics_port in the images and manifests: start a "
                        "worker by hand with --metrics-port 9107)")
    p.add_argument("--json", action="store_true", help="print the worker's JSON")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a worker")


def fetch(url: str, container: str | None, timeout_s: float = 5.0) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) of one worker's ``/scorecard/`` view; OSError when it cannot be reached."""
    q = "" if not container else "?" + urllib.parse.urlencode({"container": container})
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/scorecard/" + q, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {"error": f"HTTP {e.code} {e.reason}"}


def _n(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "bytes":
        return f"{v / 2**20:,.0f}Mi"
    return f"{v:.3g}"


def format_card(card: dict[str, Any]) -> str:
    """The text ``explain`` prints for one container."""
    wl = card.get("workload") or {}
    asked = wl.get("policy")
    worker = card.get("worker_policy", card.get("policy"))
    head = (f"policy {card.get('policy')}: the workload's, from {wl.get('source')}; worker default {worker}"
            if asked else f"policy {card.get('policy')}: the worker's default")
    out = [f"container {card['container']}  ({head})"]
    who = card.get("identity") or {}
    if who.get("pod_name"):
        out.append(f"pod {who.get('pod_namespace')}/{who['pod_name']} container {who.get('container_name')} "
                   f"(qos {who.get('qos')}, {who.get('runtime')}, layout {who.get('layout')})")
    elif who:
        out.append(f"layout {who.get('layout')}, container id {who.get('container_id')}")
    if card.get("refused"):
        out.append(f"refused: {card['refused']}")
        return "\n".join(out)
    if wl:
        bounds = {k: v for k, v in wl.items() if k.endswith(("_min_cores", "_max_cores", "_min_bytes", "_max_bytes"))}
        out.append(f"mode {wl.get('mode')} (from {wl.get('source')})"
                   + (": decided and published, never written" if wl.get("mode") == "recommend" else "")
                   + (f"; bounds {bounds}" if bounds else ""))
    now = card.get("now") or {}
    out.append(f"now (event time {now.get('t')}):")
    out.append(f"  {'resource':<9}{'used':>10}{'limit':>10}{'vpa':>10}{'phase':>10}")
    for r, unit in (("cpu", ""), ("mem", "bytes")):
        v = now.get(r) or {}
        out.append(f"  {r:<9}" + "".join(f"{_n(v.get(k), unit):>10}" for k in ("used", "limit", "vpa", "phase")))
    vpa = card.get("vpa")
    if vpa:
        rec = vpa.get("recommendation") or {}
        for r, unit in (("cpu", ""), ("mem", "bytes")):
            b = rec.get(r) or {}
            out.append(f"vpa {r}: target {_n(b.get('target'), unit)}, bounds [{_n(b.get('lower'), unit)}, "
                       f"{_n(b.get('upper'), unit)}]")
        nums = vpa.get("numbers") or {}
        out.append(f"vpa history: {nums.get('cpu_samples')} cpu samples, {nums.get('mem_peaks')} memory peaks, "
                   f"{_n(nums.get('history_s'))} s, confidence {_n(nums.get('confidence'))}")
    ph = card.get("phase")
    if ph:
        out.append(f"phase: {ph.get('phase')} since {ph.get('since')} (model v{ph.get('model_version')}); "
                   f"limit from the phase: {ph.get('from_phase')}; basis quantile {ph.get('basis_quantile')}")
    out.append("scorecard (alloc/used: allocated per unit used, 1 = oracle; fulfilment: share of samples covered):")
    out.append(f"  {'window':>8} {'resource':<9}{'policy':<7}{'alloc/used':>11}{'fulfilment':>11}{'steps':>7}")
    for row in card.get("scorecard") or []:
        if "note" in row:
            tail = f"  ({row['note']})"
            nums_txt = f"{'-':>11}{'-':>11}{'-':>7}"
        else:
            tail = ""
            nums_txt = f"{_n(row['alloc_over_used']):>11}{_n(row['fulfilment']):>11}{row['steps']:>7}"
        out.append(f"  {row['window_s']:>7g}s {row['resource']:<9}{row['policy']:<7}{nums_txt}{tail}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    workers = args.worker or [DEFAULT_WORKER]
    found: list[dict[str, Any]] = []
    listed: dict[str, list[str]] = {}
    refused: dict[str, list[str]] = {}
    errors: list[str] = []
    for url in workers:
        try:
            status, body = fetch(url, args.container, args.timeout)
        except OSError as e:
            errors.append(f"{url}: {getattr(e, 'reason', e)} (a worker serves /scorecard/ on its metrics_port)")
            continue
        if status == 200 and args.container:
            found.append(body)
        elif status == 200:
            listed[url] = list(body.get("containers") or [])
            refused[url] = list(body.get("refused") or [])
        elif status != 404:
            errors.append(f"{url}: {body.get('error', status)}")
    if errors and not (found or listed):
        for e in errors:
            print(f"phasewise explain: error: {e}", file=sys.stderr)
        return 1
    if not args.container:
        if args.json:
            print(json.dumps({u: {"containers": k, "refused": refused.get(u, [])} for u, k in listed.items()},
                             indent=1))
        else:
            for url, keys in listed.items():
                print(f"{url}: {len(keys)} containers")
                for k in keys:
                    print(f"  {k}")
                gone = refused.get(url) or []
                if gone:
                    print(f"{url}: {len(gone)} refused (their workload asks for a policy this worker does not run)")
                    for k in gone:
                        print(f"  {k}")
        return 0
    if not found:
        print(f"phasewise explain: error: no worker holds container {args.container!r}"
              + (f" ({'; '.join(errors)})" if errors else ""), file=sys.stderr)
        return 1
    for card in found:
        print(json.dumps(card, indent=1) if args.json else format_card(card))
    return 0
