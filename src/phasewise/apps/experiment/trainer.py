"""A small real training job that honours checkpoint-and-exit (SIGUSR1), for the priorities experiment
(``python -m phasewise.apps.experiment.trainer NAME --checkpoint-dir D``; docs/priorities.md, "The
experiment"); with ``--eval-every`` / ``--checkpoint-every`` it also evaluates on held-out rows and
checkpoints on a timer, each stage's begin and end printed (the corpus, docs/phases.md).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["main", "parse_line"]


def parse_line(line: str) -> dict[str, str]:
    """``key=value`` fields of a progress line."""
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phasewise.apps.experiment.trainer")
    p.add_argument("name")
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=0.0, help="training time, 0 = until stopped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width (64x<hidden>x<hidden>x8)")
    p.add_argument("--rows", type=int, default=4096, help="rows of the teacher's data set (default 4096)")
    p.add_argument("--batch-size", type=int, default=64, help="training batch size (default 64)")
    p.add_argument("--eval-every", type=float, default=0.0,
                   help="seconds between evaluations on held-out rows (default 0: none)")
    p.add_argument("--checkpoint-every", type=float, default=0.0,
                   help="seconds between checkpoints (default 0: only on SIGUSR1)")
    p.add_argument("--hold", action="store_true",
                   help="after loading, print phase=ready and wait for a line on stdin before training")
    a = p.parse_args(argv)

    flags = {"checkpoint": False, "stop": False}
    signal.signal(signal.SIGUSR1, lambda *_: flags.__setitem__("checkpoint", True))
    signal.signal(signal.SIGTERM, lambda *_: flags.__setitem__("stop", True))

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    if a.eval_every or a.checkpoint_every:
        print(f"job={a.name} phase=load step=0 rows={a.rows}", flush=True)
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    x_all = torch.randn(max(2, a.rows), 64)
    with torch.no_grad():
        y_all = teacher(x_all)
    n_train = x_all.shape[0] - max(1, x_all.shape[0] // 10) if a.eval_every else x_all.shape[0]
    h = a.hidden
    model = torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                                torch.nn.ReLU(), torch.nn.Linear(h, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = a.checkpoint_dir / f"{a.name}.pt"
    a.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
        print(f"job={a.name} phase=resume step={step}", flush=True)
    else:
        print(f"job={a.name} phase=start step=0", flush=True)
    gen = torch.Generator().manual_seed(a.seed + step)
    if a.hold:
        print(f"job={a.name} phase=ready step={step}", flush=True)
        sys.stdin.readline()
    def save() -> int:
        buf = io.BytesIO()
        torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
        tmp = ckpt.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ckpt)
        return len(buf.getbuffer())

    t0 = time.monotonic()
    last_print = 0.0
    next_eval = t0 + a.eval_every if a.eval_every > 0 else float("inf")
    next_ckpt = t0 + a.checkpoint_every if a.checkpoint_every > 0 else float("inf")
    loss = float("nan")
    while not flags["stop"] and not (a.seconds and time.monotonic() - t0 >= a.seconds):
        if flags["checkpoint"]:
            save()
            print(f"job={a.name} phase=exit step={step}", flush=True)
            os._exit(0)  # the checkpoint is durable: no interpreter teardown (seconds of torch unloading)
        if time.monotonic() >= next_eval:
            print(f"job={a.name} phase=eval step={step}", flush=True)
            with torch.no_grad():
                held = model(x_all[n_train:])
                eval_loss = float(torch.nn.functional.mse_loss(held, y_all[n_train:]))
            print(f"job={a.name} phase=eval step={step} eval_loss={eval_loss:.5f}", flush=True)
            next_eval, last_print = time.monotonic() + a.eval_every, 0.0
        if time.monotonic() >= next_ckpt:
            print(f"job={a.name} phase=checkpoint step={step}", flush=True)
            size = save()
            print(f"job={a.name} phase=checkpoint step={step} bytes={size}", flush=True)
            next_ckpt, last_print = time.monotonic() + a.checkpoint_every, 0.0
        idx = torch.randint(0, n_train, (a.batch_size,), generator=gen)
        out = model(x_all[idx])
        lo = torch.nn.functional.mse_loss(out, y_all[idx])
        opt.zero_grad(set_to_none=True)
        lo.backward()
        opt.step()
        step += 1
        loss = float(lo.detach())
        now = time.monotonic()
        if now - last_print >= 0.2:
            print(f"job={a.name} phase=train step={step} loss={loss:.5f}", flush=True)
            last_print = now
    print(f"job={a.name} phase=done step={step} loss={loss:.5f}", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
