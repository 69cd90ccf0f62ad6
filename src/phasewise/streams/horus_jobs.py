"""A job spec's graph features: the catalog's models built here (cached), a ``module:function`` only if
``horus_model_modules`` allows its module, and then in a child process with time and memory limits
(:mod:`phasewise.streams.horus_child`); every failure is a
:class:`~phasewise.models.horus.graph_features.FeatureError` with the reason. Narrative:
docs/horus.md, "Models outside the catalog"; docs/security.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import JobSpec
from phasewise.models.horus.catalog import (
    DATASETS,
    MODELS,
    canonical_dataset,
    canonical_model,
    entry_point_refusal,
    is_entry_point,
    parse_module_list,
)
from phasewise.models.horus.graph_features import FeatureError, GraphFeatures, catalog_features

__all__ = ["BuildRules", "spec_features", "spec_features_async", "resolve_entry_point", "warm_up",
           "CHILD_MODULE"]

#: the child's entry point module (the fork server imports it, and torch with it, once)
CHILD_MODULE = "phasewise.streams.horus_child"
#: the longest answer read from the build server (features are a few hundred bytes)
MAX_ANSWER_BYTES = 64 * 2**10
#: ``module:function`` features kept (least recently used dropped first)
CACHE_SIZE = 1024

_CACHE: OrderedDict[tuple[str, str, int, bool], GraphFeatures] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_FIELDS = {f.name: f.type for f in dataclasses.fields(GraphFeatures)}


@dataclass(frozen=True, slots=True)
class BuildRules:
    """Which ``module:function`` models may be built, and the limits of the child that builds one.

    *modules*: the allowlist (each with its submodules); empty = catalog models only.
    """

    modules: tuple[str, ...] = ()
    timeout_s: float = 60.0
    memory_bytes: int = 4 * 2**30

    @classmethod
    def from_settings(cls, settings: Any) -> BuildRules:
        h = settings.horus
        return cls(parse_module_list(h.model_modules), h.build_timeout_s, h.build_memory_bytes)

    def refusal(self, model: str) -> str | None:
        """Why *model* (a ``module:function``) is not built here, or None."""
        return entry_point_refusal(model, self.modules)


def resolve_entry_point(name: str) -> Any:
    """The callable ``module:function`` names, imported here; :class:`FeatureError` when there is none.

    Runs the module's code in this process: horus calls it only inside the child (:mod:`horus_child`).
    """
    if not is_entry_point(name):
        raise FeatureError(f"unknown model {name!r}: neither a catalog name nor module:function")
    mod, _, fn = name.partition(":")
    try:
        module = importlib.import_module(mod)
    except Exception as e:  # ImportError, or whatever the module's top level raises
        raise FeatureError(f"model {name}: cannot import {mod}: {type(e).__name__}: {e}") from None
    func = getattr(module, fn, None)
    if not callable(func):
        raise FeatureError(f"model {name}: {mod} has no callable {fn!r}")
    return func


def _check_names(spec: JobSpec, rules: BuildRules) -> str:
    """The canonical dataset of an entry-point spec that may be built; FeatureError otherwise."""
    if not is_entry_point(spec.model):
        raise FeatureError(f"unknown model {spec.model!r}: neither a catalog name ({', '.join(MODELS)}, "
                           f"mlp-...) nor module:function")
    why = rules.refusal(spec.model)
    if why is not None:
        raise FeatureError(f"model {spec.model}: {why}")
    ds = canonical_dataset(spec.dataset)
    if ds is None:
        raise FeatureError(f"unknown dataset {spec.dataset!r} (known: {', '.join(DATASETS)})")
    return ds


def _cached(key: tuple[str, str, int, bool]) -> GraphFeatures | None:
    with _CACHE_LOCK:
        f = _CACHE.get(key)
        if f is not None:
            _CACHE.move_to_end(key)
        return f


def _remember(key: tuple[str, str, int, bool], f: GraphFeatures) -> None:
    with _CACHE_LOCK:
        _CACHE[key] = f
        _CACHE.move_to_end(key)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)


def spec_features(spec: JobSpec, rules: BuildRules | None = None) -> GraphFeatures:
    """The graph features of one training step of the job *spec* describes (cached per model/data/batch/amp).

    A catalog model is built here; a ``module:function`` allowed by *rules*
    (default: none) in a child process, this call waiting for it.
    """
    if canonical_model(spec.model) is not None:
        return catalog_features(spec.model, spec.dataset, spec.batch_size, spec.amp)
    rules = rules or BuildRules()
    key = (spec.model, _check_names(spec, rules), spec.batch_size, spec.amp)
    f = _cached(key)
    if f is None:
        f = build_in_child(*key, rules)
        _remember(key, f)
    return f


async def spec_features_async(spec: JobSpec, rules: BuildRules) -> GraphFeatures:
    """:func:`spec_features` for an event loop: a child's build is awaited in a thread, the loop runs on."""
    if canonical_model(spec.model) is not None:
        return catalog_features(spec.model, spec.dataset, spec.batch_size, spec.amp)
    key = (spec.model, _check_names(spec, rules), spec.batch_size, spec.amp)
    f = _cached(key)
    if f is None:
        f = await asyncio.to_thread(build_in_child, *key, rules)
        _remember(key, f)
    return f


# ------------------------------------------------------------------------------------------- the child


class _BuildServer:
    """``python -m phasewise.streams.horus_child``: started once, started again when it is gone.

    Started with this process's environment less the ``PHASEWISE_*`` variables
    (settings, the Kafka password) and no descriptor but its standard streams;
    it imports torch once and forks a builder per request (:mod:`horus_child`).
    One request at a time.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
        proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, close_fds=True, bufsize=0)
        line = self._readline(proc, READY_TIMEOUT_S)
        if line != b'{"ready": true}\n':
            self._kill(proc)
            raise FeatureError(f"the build server did not start (it said {line[:200]!r})")
        return proc

    @staticmethod
    def _readline(proc: subprocess.Popen, timeout_s: float) -> bytes:
        """One line from the server within *timeout_s* (unbuffered: what select sees is all there is); what
        came before the deadline, EOF or the size limit otherwise (no newline at its end)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout_s
        while not buf.endswith(b"\n") and len(buf) <= MAX_ANSWER_BYTES + 1024:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
        return buf

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass
        proc.kill()
        proc.wait(10)

    def ensure_running(self) -> None:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()

    def request(self, req: dict, timeout_s: float) -> Any:
        """The server's answer to *req* (decoded JSON); FeatureError when it gives none."""
        with self.lock:
            for attempt in (1, 2):  # a server that died since the last request (killed by a builder?) restarts
                if self.proc is None or self.proc.poll() is not None:
                    self.proc = self._start()
                try:
                    data = memoryview(json.dumps(req).encode() + b"\n")
                    while data:  # (unbuffered: a write may take part of it)
                        data = data[self.proc.stdin.write(data):]  # type: ignore[union-attr]
                except (BrokenPipeError, OSError):
                    self._kill(self.proc)
                    self.proc = None
                    if attempt == 2:
                        raise FeatureError(f"model {req['model']}: the build server is gone") from None
                    continue
                line = self._readline(self.proc, timeout_s + ANSWER_MARGIN_S)
                if not line.endswith(b"\n"):
                    self._kill(self.proc)
                    self.proc = None
                    raise FeatureError(f"model {req['model']}: the build server gave no answer (stopped; it is "
                                       f"started again for the next model)")
                try:
                    return json.loads(line)
                except (ValueError, RecursionError):
                    raise FeatureError(f"model {req['model']}: the build server's answer is not JSON") from None
            raise AssertionError("unreachable")


_SERVER = _BuildServer()
#: seconds the build server may take to start (it imports torch)
READY_TIMEOUT_S = 120.0
#: seconds past a build's own time limit that its answer may take to come back
ANSWER_MARGIN_S = 15.0


def warm_up() -> None:
    """Start the build server now (it imports torch: seconds), not at the first job's build."""
    _SERVER.ensure_running()


def _features_of(model: str, dataset: str, batch: int, amp: bool, ok: Any) -> GraphFeatures:
    """The child's ``ok`` answer as :class:`GraphFeatures`, every field checked; FeatureError otherwise."""
    if type(ok) is not dict:
        raise FeatureError(f"model {model}: the child's answer is not an object")
    vals = {}
    for name, tp in _FIELDS.items():
        v = ok.get(name)
        want = {"str": str, "bool": bool, "int": int}[tp if isinstance(tp, str) else tp.__name__]
        if type(v) is not want or (want is int and not 0 <= v < 2**63):
            raise FeatureError(f"model {model}: the child's answer has no valid {name!r}")
        vals[name] = v
    if (vals["model"], vals["dataset"], vals["batch_size"], vals["amp"]) != (model, dataset, batch, amp):
        raise FeatureError(f"model {model}: the child answered for another job")
    return GraphFeatures(**vals)


def build_in_child(model: str, dataset: str, batch: int, amp: bool, rules: BuildRules) -> GraphFeatures:
    """Build ``module:function`` *model* in a child process under *rules*' limits; its features or FeatureError."""
    ds = DATASETS[dataset].name
    answer = _SERVER.request({"model": model, "dataset": ds, "batch": batch, "amp": amp,
                              "memory_bytes": rules.memory_bytes, "timeout_s": rules.timeout_s,
                              "sys_path": sys.path}, rules.timeout_s)
    if type(answer) is dict and type(answer.get("error")) is str:
        raise FeatureError(answer["error"][:500])
    if type(answer) is not dict or "ok" not in answer:
        raise FeatureError(f"model {model}: the child's answer has neither features nor an error")
    return _features_of(model, ds, batch, amp, answer["ok"])
