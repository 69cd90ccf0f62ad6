"""``phasewise predict measure``: real training jobs of catalog models on this machine, their CPU cores and
host memory over the steady phase (GPU utilisation and memory through NVML with a CUDA device), one row
each in the observed-jobs CSV form of ``phasewise predict eval`` (docs/horus.md, "Results").
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import os, sys, time, torch
from phasewise.models.horus.catalog import DATASETS, canonical_dataset, canonical_model
from phasewise.models.horus.zoo import build, input_kind, optimizer
from phasewise.models.horus.graph_features import inputs_for
model, dataset, batch, threads, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(threads)
key, shape = canonical_model(model), DATASETS[canonical_dataset(dataset)]
net = build(key, shape).to(device)
opt = (torch.optim.Adam(net.parameters(), 1e-4) if optimizer(key) == "adam"
       else torch.optim.SGD(net.parameters(), 0.01, momentum=0.9))
kind = input_kind(key)
bounds = {"tokens": (shape.vocab,), "seq2seq": (shape.vocab, shape.tgt_vocab),
          "ratings": (shape.users, shape.items)}.get(kind, ())
def batch_of():
    xs = inputs_for(kind, shape, batch, device)
    return tuple(torch.randn(x.shape, device=device) if x.is_floating_point()
                 else torch.randint(0, bounds[i], x.shape, device=device) for i, x in enumerate(xs))
print("ready", flush=True)
parent = os.getppid()
while os.getppid() == parent:  # ends when the measuring process is gone
    out = net(*batch_of())
    outs = out if isinstance(out, (tuple, list)) else (out,)
    loss = sum(o.float().pow(2).mean() for o in outs)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) * 1024
    return 0.0


def measure(model: str, dataset: str, batch: int, *, seconds: float = 12.0, warmup: float = 4.0,
            interval: float = 0.5, threads: int = 1, device: str = "cpu") -> dict:
    """One job's row: mean CPU cores and mean RSS (MiB) over its steady phase."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, model, dataset, str(batch), str(threads), device],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline() if p.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"{model}: the job did not start: {(p.stderr.read() if p.stderr else '')[-300:]}")
        time.sleep(warmup)
        t0, c0 = time.monotonic(), _cpu_s(p.pid)
        rss = []
        while time.monotonic() - t0 < seconds:
            time.sleep(interval)
            if p.poll() is not None:
                raise RuntimeError(f"{model}: the job exited: {(p.stderr.read() if p.stderr else '')[-300:]}")
            rss.append(_rss(p.pid))
        cores = (_cpu_s(p.pid) - c0) / (time.monotonic() - t0)
    finally:
        p.kill()
        p.wait()
    return {"model": model, "dataset": dataset, "batchsize": batch, "amp": "false", "gpu_util": "", "gmem": "",
            "cpu_cores": round(cores, 3), "mem": round(sum(rss) / len(rss) / 2**20, 1), "threads": threads,
            "device": device}
