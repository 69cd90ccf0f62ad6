"""The targets experiment's five small, real PyTorch training jobs (TRADL's model kinds), on one CPU thread.

Run one as ``python -m phasewise.apps.experiment.targets_jobs NAME --steps N``
(``cnn``, ``gru``, ``lstm``, ``rnn``: next-byte models over the standard
library's source; ``vae``: windows of the AI4DL trace). Seeds are fixed, so a
job's loss at step *k* is the same in every run; SIGTERM checkpoints and
exits 0. docs/targets.md, "Experiment: NA / AO / FT / SR with real jobs".
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

JOBS = ("cnn", "gru", "lstm", "vae", "rnn")
#: bytes of standard-library text the sequence models read
CORPUS_BYTES = 400_000


def _text_data():
    import torch

    from phasewise.apps.demo.jobs import read_bytes, stdlib_sources

    text = read_bytes(stdlib_sources(), CORPUS_BYTES)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def _seq_batch(data, seq: int, size: int, gen) -> tuple:
    import torch

    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def build(name: str, seed: int) -> tuple[object, Callable[[], object], float]:
    """(model, a function giving one step's loss tensor, learning rate)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if name in ("gru", "lstm", "rnn", "cnn"):
        data = _text_data()
        seq, size = 32, 16

        class Recurrent(nn.Module):
            def __init__(self, cell: type) -> None:
                super().__init__()
                self.emb = nn.Embedding(256, 24)
                self.rnn = cell(24, 48, batch_first=True)
                self.out = nn.Linear(48, 256)

            def forward(self, x):
                h, _ = self.rnn(self.emb(x))
                return self.out(h)

        class Conv(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(256, 24)
                self.c1 = nn.Conv1d(24, 48, 4)
                self.c2 = nn.Conv1d(48, 48, 4, dilation=2)
                self.out = nn.Linear(48, 256)

            def forward(self, x):
                h = self.emb(x).transpose(1, 2)
                h = torch.relu(self.c1(nn.functional.pad(h, (3, 0))))
                h = torch.relu(self.c2(nn.functional.pad(h, (6, 0))))
                return self.out(h.transpose(1, 2))

        model = Conv() if name == "cnn" else Recurrent({"gru": nn.GRU, "lstm": nn.LSTM, "rnn": nn.RNN}[name])

        def step_loss():
            x, y = _seq_batch(data, seq, size, gen)
            return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

        return model, step_loss, {"cnn": 3e-3, "gru": 3e-3, "lstm": 3e-3, "rnn": 1e-3}[name]
    if name == "vae":
        from phasewise.apps.demo.jobs import ai4dl_path, ai4dl_series

        path = ai4dl_path()
        if path is None:
            raise SystemExit("phasewise.apps.experiment.targets_jobs vae: the AI4DL trace is not installed")
        series = [s for s in ai4dl_series(path).values() if len(s) > 40]
        w = 32
        windows = torch.tensor([[v for pair in s[i:i + w] for v in pair] for s in series
                                for i in range(0, len(s) - w, 4)], dtype=torch.float32)
        windows = (windows - windows.mean(0)) / (windows.std(0) + 1e-6)

        class VAE(nn.Module):
            def __init__(self, d: int = 2 * w, z: int = 4) -> None:
                super().__init__()
                self.enc = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 2 * z))
                self.dec = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, d))

            def forward(self, x):
                mu, logvar = self.enc(x).chunk(2, dim=1)
                zs = mu + torch.randn(mu.shape, generator=gen) * (0.5 * logvar).exp()
                return self.dec(zs), mu, logvar

        model = VAE()

        def step_loss():
            idx = torch.randint(0, len(windows), (32,), generator=gen)
            x = windows[idx]
            recon, mu, logvar = model(x)
            rec = nn.functional.mse_loss(recon, x, reduction="sum") / len(x)
            kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / len(x)
            return (rec + kl) / x.shape[1]

        return model, step_loss, 2e-3
    raise SystemExit(f"phasewise.apps.experiment.targets_jobs: unknown job {name!r} (one of {', '.join(JOBS)})")


def train(name: str, steps: int, report_every: int, seed: int, checkpoint_dir: Path | None, out=sys.stdout,
          wait_for_go: bool = False, seconds: float = 0.0) -> int:
    import torch

    torch.set_num_threads(1)
    stop = {"requested": False}

    def on_term(_signum, _frame):
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_term)
    model, step_loss, lr = build(name, seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    t0 = time.monotonic()

    def emit(text: str) -> None:
        out.write(f"job={name} {text} elapsed={time.monotonic() - t0:.2f}\n")
        out.flush()

    emit("phase=ready")
    if wait_for_go:  # a start barrier: the experiment starts every job's clock at once, after loading
        sys.stdin.readline()
    t0 = time.monotonic()
    acc, n = 0.0, 0
    step = 0
    while (steps <= 0 or step < steps) and not (seconds > 0 and time.monotonic() - t0 >= seconds) \
            and not stop["requested"]:
        loss = step_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        acc += float(loss.detach())
        n += 1
        if step % report_every == 0 or step == steps:
            value = acc / n
            emit(f"phase=train step={step} loss={value:.5f}" if math.isfinite(value) else f"phase=error step={step}")
            acc, n = 0.0, 0
    if stop["requested"] and checkpoint_dir is not None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        path = checkpoint_dir / f"{name}-{step:07d}.pt"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path)
        emit(f"phase=checkpoint step={step} bytes={path.stat().st_size}")
    emit(f"phase=done step={step}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phasewise.apps.experiment.targets_jobs",
                                description=__doc__.splitlines()[0])
    p.add_argument("name", choices=JOBS)
    p.add_argument("--steps", type=int, default=0, help="training steps (0: no bound; give it or --seconds)")
    p.add_argument("--seconds", type=float, default=0.0, help="training time (0: no bound)")
    p.add_argument("--report-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path)
    p.add_argument("--wait-for-go", action="store_true", help="after loading, wait for a line on stdin")
    a = p.parse_args(argv)
    if a.steps <= 0 and a.seconds <= 0:
        p.error("give --steps or --seconds")
    return train(a.name, a.steps, a.report_every, a.seed, a.checkpoint_dir, wait_for_go=a.wait_for_go,
                 seconds=a.seconds)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    # the checkpoint is written and closed: skip the interpreter's and torch's teardown, which takes
    # seconds on a CPU-limited job and would count against its grace period
    os._exit(rc)
