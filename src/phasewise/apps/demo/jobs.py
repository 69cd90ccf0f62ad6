"""Three small but real PyTorch training jobs for the demo, on the CPU.

``charlstm``, ``transformer`` and ``forecaster``; run one as
``python -m phasewise.apps.demo.jobs NAME --seconds N``. Each has
a real run's phases (load, train, eval, checkpoint), resumes from its newest
checkpoint, prints one ``key=value`` line per event and ends after the
current step on SIGTERM. Nothing is downloaded. docs/operations.md, "The
demo".
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import signal
import sys
import sysconfig
import tempfile
import time
import tokenize
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

__all__ = ["DEFAULT_JOBS", "JOBS", "JobError", "ai4dl_path", "main", "parse_progress", "stdlib_sources"]

#: the demo's three jobs (``forecaster`` becomes ``convlm`` without the trace)
DEFAULT_JOBS = ("charlstm", "transformer", "forecaster")
JOBS = ("charlstm", "transformer", "forecaster", "convlm")

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


class JobError(RuntimeError):
    """A job cannot run (e.g. no corpus); ``str(e)`` says why."""


# --------------------------------------------------------------------------- progress lines


def format_progress(fields: dict[str, object]) -> str:
    parts = []
    for k, v in fields.items():
        if isinstance(v, float):
            v = f"{v:.4f}" if k == "loss" else f"{v:.2f}"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def parse_progress(line: str) -> dict[str, str | int | float] | None:
    """A job's ``key=value`` line as a dict (``step`` int, ``loss`` float), else None.

    >>> parse_progress("job=charlstm phase=train step=12 loss=2.5000 elapsed=1.20")
    {'job': 'charlstm', 'phase': 'train', 'step': 12, 'loss': 2.5, 'elapsed': 1.2}
    >>> parse_progress("some other output") is None
    True
    """
    out: dict[str, str | int | float] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if not sep or not key:
            return None
        if key == "step":
            try:
                out[key] = int(value)
            except ValueError:
                return None
        elif key in ("loss", "elapsed", "eval_loss", "mb", "seconds"):
            try:
                out[key] = float(value)
            except ValueError:
                return None
        else:
            out[key] = value
    return out if "job" in out and "phase" in out else None


# --------------------------------------------------------------------------- corpora


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(*, tests: bool = False, root: Path | None = None) -> list[Path]:
    """The interpreter's standard-library ``.py`` files in a stable order.

    ``tests=False`` gives the library proper (no ``test``/``tests`` folders and
    no ``site-packages``); ``tests=True`` gives only the test sources.
    """
    root = root or stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = set(p.relative_to(root).parts[:-1])
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        is_test = bool(parts & {"test", "tests", "idle_test"})
        if is_test == tests:
            out.append(p)
    return out


def read_bytes(paths: Sequence[Path], max_bytes: int) -> bytes:
    """Concatenated file contents, at most *max_bytes*, skipping unreadable files."""
    buf = io.BytesIO()
    for p in paths:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        buf.write(data)
        buf.write(b"\n")
        if buf.tell() >= max_bytes:
            break
    out = buf.getvalue()[:max_bytes]
    if not out:
        raise JobError("no standard-library source text found to train on")
    return out


def python_tokens(paths: Sequence[Path], max_tokens: int) -> list[str]:
    """Python tokens of the sources (names, operators, literals shortened)."""
    out: list[str] = []
    skip = {tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER}
    for p in paths:
        try:
            data = p.read_bytes()
            for tok in tokenize.tokenize(io.BytesIO(data).readline):
                if tok.type in skip:
                    continue
                if tok.type == tokenize.STRING:
                    out.append("<str>")
                elif tok.type == tokenize.NUMBER:
                    out.append("<num>")
                elif tok.type == tokenize.NEWLINE:
                    out.append("<nl>")
                elif tok.type == tokenize.INDENT:
                    out.append("<indent>")
                elif tok.type == tokenize.DEDENT:
                    out.append("<dedent>")
                else:
                    out.append(tok.string)
        except (OSError, SyntaxError, tokenize.TokenError, UnicodeDecodeError):
            continue
        if len(out) >= max_tokens:
            break
    if not out:
        raise JobError("no standard-library sources could be tokenised")
    return out[:max_tokens]


def ai4dl_path() -> Path | None:
    """The project's copy of the AI4DL trace, or None when it is not shipped."""
    p = DATA_DIR / "ai4dl_sample.csv"
    return p if p.is_file() else None


def ai4dl_series(path: Path) -> dict[str, list[tuple[float, float]]]:
    """``{pod: [(cpu cores, memory working set / limit), ...]}`` in time order."""
    series: dict[str, list[tuple[float, float, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                t = float(row["timestamp"])
                cpu = float(row["cpu.usage.cores"])
                mem = float(row["mem.working.set"]) / max(float(row["mem.limit"]), 1.0)
            except (KeyError, ValueError) as e:
                raise JobError(f"{path}: unexpected row {row!r}: {e}") from None
            pod = f'{row.get("service", "")}/{row.get("pod.id", "")}'
            series.setdefault(pod, []).append((t, cpu, mem))
    return {k: [(c, m) for _, c, m in sorted(v)] for k, v in series.items()}


# --------------------------------------------------------------------------- the training loop


@dataclass
class Task:
    """What differs between jobs: data, model and how to draw batches."""

    name: str
    model: object
    batch: Callable[[int, bool], tuple]  # (batch size, held-out?) -> (inputs, targets)
    loss: Callable[[tuple], object]  # batch -> scalar loss tensor
    batch_size: int
    lr: float
    info: dict[str, object] = field(default_factory=dict)


class Stop:
    """Set by SIGTERM/SIGINT so the loop ends after the current step."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        def handler(signum: int, frame: object) -> None:
            self.requested = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def build_task(name: str, seed: int, scale: float = 1.0) -> Task:
    """Load the corpus and build the model for job *name* (the ``load`` phase)."""
    import torch

    torch.manual_seed(seed)
    if name == "forecaster":
        path = ai4dl_path()
        if path is None:
            name = "convlm"
        else:
            return _forecaster(path, seed)
    if name == "charlstm":
        return _charlstm(seed, scale)
    if name == "transformer":
        return _transformer(seed, scale)
    if name == "convlm":
        return _convlm(seed, scale)
    raise JobError(f"unknown job {name!r}; choose from {', '.join(JOBS)}")


def _split(n: int, held_out: float = 0.1) -> int:
    return max(1, int(n * (1 - held_out)))


def _sequence_batcher(data: object, seq: int, seed: int) -> Callable[[int, bool], tuple]:
    import torch

    n = len(data)
    cut = _split(n)
    gen = torch.Generator().manual_seed(seed)

    def batch(size: int, held_out: bool) -> tuple:
        lo, hi = (cut, n - seq - 1) if held_out else (0, cut - seq - 1)
        if hi <= lo:
            lo, hi = 0, n - seq - 1
        starts = torch.randint(lo, hi, (size,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        chunk = data[idx].long()
        return chunk[:, :-1], chunk[:, 1:]

    return batch


def _charlstm(seed: int, scale: float) -> Task:
    import torch
    from torch import nn

    text = read_bytes(stdlib_sources(), int(3_000_000 * scale))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)

    class CharLSTM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(256, 64)
            self.lstm = nn.LSTM(64, 192, num_layers=2, batch_first=True)
            self.out = nn.Linear(192, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.lstm(self.emb(x))
            return self.out(h)

    model = CharLSTM()
    crit = nn.CrossEntropyLoss()

    def loss(b: tuple) -> torch.Tensor:
        x, y = b
        return crit(model(x).reshape(-1, 256), y.reshape(-1))

    return Task("charlstm", model, _sequence_batcher(data, 96, seed), loss, batch_size=32, lr=3e-3,
                info={"corpus_bytes": len(text)})


def _transformer(seed: int, scale: float) -> Task:
    import torch
    from torch import nn

    tokens = python_tokens(stdlib_sources(), int(400_000 * scale))
    vocab = ["<unk>"] + [t for t, _ in Counter(tokens).most_common(1023)]
    index = {t: i for i, t in enumerate(vocab)}
    data = torch.tensor([index.get(t, 0) for t in tokens], dtype=torch.int16)
    V, D, S = len(vocab), 128, 64

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.pos = nn.Parameter(torch.zeros(1, S, D))
            layer = nn.TransformerEncoderLayer(D, nhead=4, dim_feedforward=256, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
            self.out = nn.Linear(D, V)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(S), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = x.shape[1]
            h = self.emb(x) + self.pos[:, :s]
            h = self.enc(h, mask=self.mask[:s, :s], is_causal=True)
            return self.out(h)

    model = TinyGPT()
    crit = nn.CrossEntropyLoss()

    def loss(b: tuple) -> torch.Tensor:
        x, y = b
        return crit(model(x).reshape(-1, V), y.reshape(-1))

    return Task("transformer", model, _sequence_batcher(data, S, seed), loss, batch_size=32, lr=1e-3,
                info={"tokens": len(tokens), "vocab": V})


def _convlm(seed: int, scale: float) -> Task:
    import torch
    from torch import nn

    paths = stdlib_sources(tests=True) or stdlib_sources()
    text = read_bytes(paths, int(3_000_000 * scale))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)

    class CausalConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(256, 64)
            layers: list[nn.Module] = []
            for dil in (1, 2, 4, 8, 16):
                layers += [nn.ConstantPad1d((2 * dil, 0), 0.0),
                           nn.Conv1d(64 if dil == 1 else 128, 128, 3, dilation=dil), nn.GELU()]
            self.net = nn.Sequential(*layers)
            self.out = nn.Conv1d(128, 256, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.net(self.emb(x).transpose(1, 2))).transpose(1, 2)

    model = CausalConv()
    crit = nn.CrossEntropyLoss()

    def loss(b: tuple) -> torch.Tensor:
        x, y = b
        return crit(model(x).reshape(-1, 256), y.reshape(-1))

    return Task("convlm", model, _sequence_batcher(data, 128, seed), loss, batch_size=32, lr=2e-3,
                info={"corpus_bytes": len(text)})


def _forecaster(path: Path, seed: int) -> Task:
    import torch
    from torch import nn

    series = ai4dl_series(path)
    W = 8
    xs, ys, held = [], [], []
    pods = sorted(series)
    for k, pod in enumerate(pods):
        rows = series[pod]
        for i in range(len(rows) - W):
            xs.append([v for r in rows[i:i + W] for v in r])
            ys.append(list(rows[i + W]))
            held.append(k == len(pods) - 1 and len(pods) > 1)  # the last pod is held out
    if not xs:
        raise JobError(f"{path}: no pod has more than {W} samples")
    X = torch.tensor(xs, dtype=torch.float32)
    Y = torch.tensor(ys, dtype=torch.float32)
    mu, sd = X.mean(0), X.std(0).clamp_min(1e-6)
    ymu, ysd = Y.mean(0), Y.std(0).clamp_min(1e-6)
    X, Y = (X - mu) / sd, (Y - ymu) / ysd
    H = torch.tensor(held)
    train_idx = (~H).nonzero().flatten()
    test_idx = H.nonzero().flatten() if bool(H.any()) else train_idx
    gen = torch.Generator().manual_seed(seed)

    def batch(size: int, held_out: bool) -> tuple:
        pool = test_idx if held_out else train_idx
        pick = pool[torch.randint(0, len(pool), (size,), generator=gen)]
        # input noise as augmentation on training batches only
        x = X[pick]
        if not held_out:
            x = x + 0.05 * torch.randn(x.shape, generator=gen)
        return x, Y[pick]

    model = nn.Sequential(nn.Linear(2 * W, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 2))
    crit = nn.MSELoss()

    def loss(b: tuple) -> torch.Tensor:
        x, y = b
        return crit(model(x), y)

    return Task("forecaster", model, batch, loss, batch_size=64, lr=1e-3,
                info={"windows": len(xs), "pods": len(pods)})


def train(
    name: str,
    *,
    seconds: float,
    steps: int = 0,
    threads: int = 1,
    seed: int = 0,
    eval_every_s: float = 10.0,
    checkpoint_every_s: float = 20.0,
    report_every_s: float = 1.0,
    checkpoint_dir: Path | None = None,
    scale: float = 1.0,
    batch_size: int = 0,
    eval_batches: int = 4,
    out: TextIO = sys.stdout,
    stop: Stop | None = None,
) -> dict[str, float]:
    """Run job *name* for *seconds* of training after loading and at least *steps* training steps (either
    0: no such bound; both 0: until stopped); returns first/last losses.

    *batch_size*: 0 keeps the job's own; *eval_batches*: held-out batches (of 4x the batch) per evaluation.
    An evaluation and a checkpoint print a line when they begin and one when they end, and the first
    training step after them is reported at once, so the lines mark where each stage begins.
    """
    t0 = time.monotonic()
    stop = stop or Stop()

    def emit(phase: str, **kv: object) -> None:
        line = format_progress({"job": name, "phase": phase, **kv, "elapsed": time.monotonic() - t0})
        out.write(line + "\n")
        out.flush()

    emit("load", mb=rss_mb())  # before torch loads: loading torch is the load phase's first part
    import torch

    torch.set_num_threads(max(1, threads))
    task = build_task(name, seed, scale)
    if task.name != name:
        emit("load", note=f"no-ai4dl-trace-using-{task.name}")
        name = task.name
    if batch_size > 0:
        task.batch_size = batch_size
    emit("load", mb=rss_mb(), batch=task.batch_size, **{k: v for k, v in task.info.items()})
    model = task.model
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr)  # type: ignore[attr-defined]

    t_train = time.monotonic()  # loading can be slow on a busy host: the budget is training time

    run_steps = 0  # in this run (a resumed job counts from its checkpoint's step)

    def done() -> bool:
        if stop.requested:
            return True
        if seconds <= 0 and steps <= 0:
            return False
        return (seconds <= 0 or time.monotonic() - t_train >= seconds) and run_steps >= steps

    first: float | None = None
    value: float | None = None  # the last step's loss in this run (None: no step yet, e.g. stopped after a resume)
    recent: list[float] = []
    step = 0
    reported = False
    next_eval = time.monotonic() + eval_every_s
    next_ckpt = time.monotonic() + checkpoint_every_s
    next_report = time.monotonic() + report_every_s
    eval_loss = math.nan
    with tempfile.TemporaryDirectory(prefix=f"phasewise-{name}-") as tmp:
        ckpt_dir = Path(checkpoint_dir) if checkpoint_dir else Path(tmp)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        resumed = load_checkpoint(model, opt, ckpt_dir, name)
        if resumed is not None:
            step = resumed
            emit("resume", step=step, mb=rss_mb())
        while not done():
            model.train()  # type: ignore[attr-defined]
            b = task.batch(task.batch_size, False)
            loss = task.loss(b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # type: ignore[attr-defined]
            opt.step()
            step += 1
            run_steps += 1
            value = float(loss.detach())
            if first is None:
                first = value
            recent.append(value)
            now = time.monotonic()
            if now >= next_report or not reported:  # the first step of a run is always reported
                emit("train", step=step, loss=sum(recent) / len(recent))
                recent.clear()
                next_report = now + report_every_s
                reported = True
            if now >= next_eval and not done():
                emit("eval", step=step)
                eval_loss = evaluate(task, batches=eval_batches)
                emit("eval", step=step, eval_loss=eval_loss, mb=rss_mb())
                next_eval = time.monotonic() + eval_every_s
                next_report = time.monotonic()  # training goes on: say so with the next step
            if now >= next_ckpt and not done():
                emit("checkpoint", step=step)
                size = save_checkpoint(model, opt, step, ckpt_dir / f"{name}-{step:07d}.pt")
                for old in sorted(ckpt_dir.glob(f"{name}-*.pt"))[:-2]:
                    old.unlink(missing_ok=True)
                emit("checkpoint", step=step, mb=rss_mb(), bytes=size)
                next_ckpt = time.monotonic() + checkpoint_every_s
                next_report = time.monotonic()
    if recent:
        last = sum(recent) / len(recent)
    else:
        last = value if value is not None else math.nan
    emit("done", step=step, loss=last, mb=rss_mb())
    return {"steps": float(step), "first_loss": first if first is not None else math.nan, "last_loss": last,
            "eval_loss": eval_loss}


def evaluate(task: Task, batches: int) -> float:
    """Held-out loss with a 4x batch and no gradients."""
    import torch

    task.model.eval()  # type: ignore[attr-defined]
    total = 0.0
    with torch.no_grad():
        for _ in range(batches):
            total += float(task.loss(task.batch(task.batch_size * 4, True)))
    return total / batches


def load_checkpoint(model: object, opt: object, ckpt_dir: Path, name: str) -> int | None:
    """Restore the newest readable checkpoint of *name* in *ckpt_dir*; its step, or None."""
    import torch

    for path in sorted(ckpt_dir.glob(f"{name}-*.pt"), reverse=True):
        try:
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])  # type: ignore[attr-defined]
            opt.load_state_dict(state["optimizer"])  # type: ignore[attr-defined]
            return int(state["step"])
        except (OSError, RuntimeError, KeyError, ValueError) as e:  # torn or foreign file: try an older one
            print(f"phasewise.apps.demo.jobs {name}: cannot resume from {path}: {e}", file=sys.stderr)
    return None


def save_checkpoint(model: object, opt: object, step: int, path: Path) -> int:
    """Serialise model and optimiser state in memory, then write and fsync it."""
    import torch

    buf = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, buf)  # type: ignore[attr-defined]
    data = buf.getbuffer()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m phasewise.apps.demo.jobs", description=__doc__.splitlines()[0])
    p.add_argument("name", choices=JOBS)
    p.add_argument("--seconds", type=float, default=0.0, help="training time after loading (0 = until SIGTERM)")
    p.add_argument("--steps", type=int, default=0,
                   help="at least this many training steps (with --seconds: and at least that long)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: about one core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=float, default=10.0, help="seconds between evaluations")
    p.add_argument("--checkpoint-every", type=float, default=20.0, help="seconds between checkpoints")
    p.add_argument("--report-every", type=float, default=1.0,
                   help="seconds between progress lines (each carries the mean training loss since the last)")
    p.add_argument("--checkpoint-dir", type=Path, help="where checkpoints go (default: a temporary folder)")
    p.add_argument("--scale", type=float, default=1.0, help="corpus size factor (smaller loads faster)")
    p.add_argument("--batch-size", type=int, default=0, help="training batch size (default 0: the job's own)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches (4x the training batch) per evaluation (default 4)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop = Stop()
    stop.install()
    try:
        import torch

        torch.set_num_interop_threads(1)
        train(args.name, seconds=args.seconds, steps=args.steps, threads=args.threads, seed=args.seed,
              eval_every_s=args.eval_every, checkpoint_every_s=args.checkpoint_every,
              report_every_s=args.report_every, checkpoint_dir=args.checkpoint_dir, scale=args.scale,
              batch_size=args.batch_size, eval_batches=max(1, args.eval_batches), stop=stop)
    except JobError as e:
        print(f"phasewise.apps.demo.jobs {args.name}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
