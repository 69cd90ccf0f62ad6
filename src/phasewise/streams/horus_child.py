"""The build server in which horus builds ``module:function`` models' graphs, one forked, limited
builder per request.

``python -m phasewise.streams.horus_child`` (started by :mod:`phasewise.streams.horus_jobs`) reads one
request per line on stdin (``{"model", "dataset", "batch", "amp", "memory_bytes", "timeout_s",
"sys_path"}``) and answers one JSON line on stdout, ``{"ok": features}`` or ``{"error": reason}``;
it never runs a model's code itself. Narrative: docs/horus.md, "Models outside the catalog", and
docs/security.md.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import resource
import select
import signal
import sys
import time
from typing import Any

__all__ = ["MAX_ANSWER_BYTES", "MAX_FILE_BYTES", "main"]

#: the largest file a builder may write (a model writing more is stopped by SIGXFSZ)
MAX_FILE_BYTES = 64 * 2**20
#: the longest answer read from a builder (features are a few hundred bytes)
MAX_ANSWER_BYTES = 64 * 2**10


def _limit(memory_bytes: int, timeout_s: float) -> None:
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    address_space = mapped + int(memory_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    cpu = math.ceil(timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))


def _isolate() -> None:
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def build(model: str, dataset: str, batch: int, amp: bool) -> dict[str, Any]:
    """The answer for one model, built in this process: ``{"ok": GraphFeatures.to_dict()}`` or ``{"error": reason}``."""
    from phasewise.models.horus.catalog import DATASETS
    from phasewise.models.horus.graph_features import FeatureError, features
    from phasewise.streams.horus_jobs import resolve_entry_point

    try:
        f = features(resolve_entry_point(model), name=model, shape=DATASETS[dataset], batch=batch, amp=amp)
        return {"ok": f.to_dict()}
    except FeatureError as e:
        return {"error": str(e)}
    except BaseException as e:  # noqa: BLE001 - whatever the model raises (SystemExit, MemoryError) is the reason
        return {"error": f"model {model}: {type(e).__name__}: {e}"}


def _builder(w: int, req: dict) -> None:
    """The forked builder: isolate, limit, build, answer on *w*; never returns."""
    code = 0
    try:
        _isolate()
        sys.path[:] = [p for p in req.get("sys_path", sys.path) if isinstance(p, str)]
        importlib.invalidate_caches()
        _limit(req["memory_bytes"], req["timeout_s"])
        answer = build(req["model"], req["dataset"], req["batch"], req["amp"])
        try:
            data = json.dumps(answer).encode()
        except (TypeError, ValueError) as e:
            data = json.dumps({"error": f"model {req['model']}: its features are not JSON: {e}"}).encode()
        os.write(w, data + b"\n")
    except BaseException:  # noqa: BLE001 - nothing more to say: the server reads the exit status
        code = 1
    os._exit(code)


def _exit_reason(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"died of {signal.Signals(sig).name}"
        except ValueError:
            return f"died of signal {sig}"
    return f"exited with status {os.waitstatus_to_exitcode(status)} without an answer"


def serve_one(req: dict) -> dict:
    """Fork a builder for *req*, wait for its answer at most ``timeout_s``; the answer or an error."""
    model, timeout_s = req["model"], float(req["timeout_s"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the builder
        os.close(r)
        _builder(w, req)
    os.close(w)
    buf = b""
    why = None
    deadline = time.monotonic() + timeout_s
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"not built within {timeout_s:g} s (horus_build_timeout_s): stopped"
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:  # every writer is gone without a whole answer
                break
            buf += chunk
            if len(buf) > MAX_ANSWER_BYTES:
                why = f"the process building it answered more than {MAX_ANSWER_BYTES} bytes"
                break
    finally:
        os.close(r)
        try:
            os.killpg(pid, signal.SIGKILL)  # the builder and what it forked (if it still is a group)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    if why is None and b"\n" not in buf:
        why = f"the process building it {_exit_reason(status)}"
    if why is not None:
        return {"error": f"model {model}: {why}"}
    try:
        answer = json.loads(buf.split(b"\n", 1)[0])
    except (ValueError, RecursionError):
        return {"error": f"model {model}: the process building it answered something that is not JSON"}
    return answer if type(answer) is dict else {"error": f"model {model}: the process building it answered "
                                                         "something that is not an object"}


def main(argv: list[str]) -> int:
    import torch  # noqa: F401 - once, here: each builder is a fork of this process

    import phasewise.streams.horus_jobs  # noqa: F401
    from phasewise.models.horus.graph_features import catalog_features

    # one step of a catalog model (phasewise's own code) here, before any fork: the lazy imports and
    # registrations of a first training step on the meta device (about a second) are paid once, not per build
    catalog_features("ppo_mlp", "lunarlander", 2, False)
    catalog_features("resnet18", "cifar10", 2, True)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this server ends (stdin closes)
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            answer = serve_one(req)
        except Exception as e:  # noqa: BLE001 - a bad request or a failed fork: its reason, and serve on
            answer = {"error": f"the build server could not build it: {type(e).__name__}: {e}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
