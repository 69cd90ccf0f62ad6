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
        return _bytes(v)
    return f"{v:.3g}"


def _bytes(v: float) -> str:
    """Binary units as Kubernetes writes them: ``512Mi``, ``1.5Gi``."""
    for unit, k in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if abs(v) >= k:
            return f"{v / k:.3g}{unit}"
    return f"{v:.0f}"


def _cores(v: Any) -> str:
    return "-" if v is None else f"{v:.3g} cores"


def _age(seconds: float) -> str:
    """A duration as ``kubectl`` shows ages: ``45s``, ``3m20s``, ``2h5m``, ``4d3h``."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def _when(t: Any, now: float) -> str:
    """An event time as its age and its UTC time: ``3s ago (20:51:02 UTC)``."""
    import time

    if t is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S" if abs(now - t) >= 86400 else "%H:%M:%S", time.gmtime(t))
    return f"{_age(now - t)} ago ({stamp} UTC)"


#: the resources as ``explain`` names them, with their unit
_RESOURCES = (("cpu", "cpu (cores)", ""), ("mem", "memory", "bytes"))


def format_card(card: dict[str, Any], now: float | None = None) -> str:
    """The text ``explain`` prints for one container; ages are counted to *now* (default: the clock)."""
    import time

    now = time.time() if now is None else now
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
        bounds = [f"{k.rsplit('_', 2)[0].replace('mem', 'memory')} {k.rsplit('_', 2)[1]} "
                  f"{_bytes(v) if k.endswith('_bytes') else _cores(v)}"
                  for k, v in wl.items() if k.endswith(("_min_cores", "_max_cores", "_min_bytes", "_max_bytes"))]
        out.append(f"mode {wl.get('mode')} (from {wl.get('source')})"
                   + (": decided and published, never written" if wl.get("mode") == "recommend" else "")
                   + (f"; bounds: {', '.join(bounds)}" if bounds else ""))
    vpa = card.get("vpa") or {}
    rec = vpa.get("recommendation") or {}
    now_ = card.get("now") or {}
    out.append(f"last sample {_when(now_.get('t'), now)}")
    out.append(f"  {'resource':<13}{'used':>10}{'limit':>10}{'vpa':>10}{'phase':>10}")
    for r, label, unit in _RESOURCES:
        v = dict(now_.get(r) or {})
        if v.get("vpa") is None:  # the VPA decides nothing here (another policy does): its target
            v["vpa"] = (rec.get(r) or {}).get("target")
        out.append(f"  {label:<13}" + "".join(f"{_n(v.get(k), unit):>10}" for k in ("used", "limit", "vpa", "phase")))
    out.append("  (limit: in force, - = none; vpa, phase: the limit each policy holds, the VPA's target where it "
               "decides nothing)")
    if vpa:
        for r, label, unit in _RESOURCES:
            b = rec.get(r) or {}
            fmt = _cores if not unit else (lambda x: "-" if x is None else _bytes(x))
            upper = "no upper bound yet" if b.get("target") is not None and b.get("upper") is None else None
            out.append(f"vpa {label.split()[0]}: target {fmt(b.get('target'))}, bounds {fmt(b.get('lower'))} to "
                       f"{upper or fmt(b.get('upper'))}")
        nums = vpa.get("numbers") or {}
        hist = nums.get("history_s")
        out.append(f"vpa history: {nums.get('cpu_samples')} cpu samples, {nums.get('mem_peaks')} memory peaks"
                   + (f" over {_age(hist)}" if hist is not None else "")
                   + f", confidence {_n(nums.get('confidence'))}")
    ph = card.get("phase")
    if ph:
        t, since, pid = now_.get("t"), ph.get("since"), ph.get("phase")
        if pid is None or pid < 0:
            out.append(f"phase: none yet (the detector has not put it in one; model v{ph.get('model_version')}):")
        else:
            span = f" for {_age(t - since)}" if t is not None and since else ""
            name = f" ({ph['name']})" if ph.get("name") else ""
            out.append(f"phase {pid}{name}{span} (model v{ph.get('model_version')}):")
        for r, label, unit in _RESOURCES:
            res = label.split()[0]
            basis = (ph.get("basis_quantile") or {}).get(r)
            if (ph.get("from_phase") or {}).get(r):
                out.append(f"  {res}: the limit comes from this phase's usage "
                           f"(basis {_n(basis, unit)}{'' if unit else ' cores'})")
            else:
                out.append(f"  {res}: the limit comes from the VPA fallback (the model is cold or the phase new)")
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
