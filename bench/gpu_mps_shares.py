"""Two training jobs sharing one GPU under CUDA MPS with the shares phasewise decides (run on a GPU host).

What the actuator does for a ``share`` decision, on a real GPU: the shares come from
``models.jobs.gpu_share.share_decisions`` (two jobs asking for 30 % and 70 % of the GPU), each job's
environment from the actuator's ``start_environment`` (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, enforced only where an MPS control daemon serves the pipe). Each
job is a small convolutional network training on random batches for a fixed time. Measured: each
job's steps/s alone (no MPS), then both at once under their shares (MPS daemon started here when
``nvidia-cuda-mps-control`` runs), with NVML's GPU utilisation sampled every 0.2 s through the host
agent's own sampler. Prints one JSON object (and writes it to ``$OUT/mps_shares.json`` when ``OUT`` is set).

    PYTHONPATH=src python3 bench/gpu_mps_shares.py --seconds 15
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

JOB = r"""
import json, sys, time, torch
seconds = float(sys.argv[1])
dev = torch.device("cuda")
nn = torch.nn
net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                    nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(dev)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x, y = torch.randn(128, 3, 64, 64, device=dev), torch.randint(0, 10, (128,), device=dev)
for _ in range(5):  # warm-up
    opt.zero_grad(); torch.nn.functional.cross_entropy(net(x), y).backward(); opt.step()
torch.cuda.synchronize()
t0, n = time.perf_counter(), 0
while time.perf_counter() - t0 < seconds:
    opt.zero_grad(); torch.nn.functional.cross_entropy(net(x), y).backward(); opt.step(); n += 1
    if n % 10 == 0: torch.cuda.synchronize()
torch.cuda.synchronize()
print(json.dumps({"steps": n, "steps_per_s": n / (time.perf_counter() - t0),
                  "mem_peak_mib": torch.cuda.max_memory_allocated() / 2**20}))
"""


def run_jobs(envs: list[dict[str, str]], seconds: float) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", JOB, str(seconds)], env={**os.environ, **e},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in envs]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=seconds + 120)
        try:
            out.append(json.loads(so.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            out.append({"error": (se.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]})
    return out


def sample_nvml(stop: threading.Event, into: list[float]) -> None:
    from phasewise.producers.nvml import NvmlSampler

    s = NvmlSampler(prefix="none")
    while not stop.is_set():
        try:
            reading = s.sample()
            if reading is None:
                print(f"nvml: {s.reason}", file=sys.stderr)
                return
            into.extend(float(g.util) for g in reading.gpus if g.util is not None)
        except Exception as e:  # noqa: BLE001 - a measurement aid: its failure is reported, not fatal
            into.append(float("nan"))
            print(f"nvml: {type(e).__name__}: {e}", file=sys.stderr)
            return
        stop.wait(0.2)


def measured(envs: list[dict[str, str]], seconds: float) -> dict:
    util: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=sample_nvml, args=(stop, util), daemon=True)
    t.start()
    jobs = run_jobs(envs, seconds)
    stop.set()
    t.join(5)
    ok = [u for u in util if u == u]
    return {"jobs": jobs, "gpu_util_mean": sum(ok) / len(ok) if ok else None, "gpu_util_samples": len(ok)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=15.0)
    args = ap.parse_args()
    from phasewise.actuators.backends.gpu_share_enforcement import start_environment
    from phasewise.models.jobs.gpu_share import ShareRequest, share_decisions

    smi = shutil.which("nvidia-smi")
    report: dict = {"nvidia_smi": subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip()
                    if smi else "not installed"}
    base = tempfile.mkdtemp(prefix="pw-mps-")
    pipe, logs = os.path.join(base, "pipe"), os.path.join(base, "log")
    os.makedirs(pipe), os.makedirs(logs)
    mps_env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs}
    report["alone"] = measured([{}], args.seconds)["jobs"][0]
    report["both_without_mps"] = measured([{}, {}], args.seconds)
    ctl = shutil.which("nvidia-cuda-mps-control")
    daemon = None
    if ctl:
        daemon = subprocess.run([ctl, "-d"], env={**os.environ, **mps_env}, capture_output=True, text=True)
        time.sleep(1.0)
    report["mps_control"] = ctl or "not installed"
    report["mps_daemon_start"] = None if daemon is None else {"rc": daemon.returncode,
                                                                "stderr": daemon.stderr.strip()[-300:]}
    decisions = share_decisions([ShareRequest("job-a", 0.3, 8 * 2**30), ShareRequest("job-b", 0.7, 16 * 2**30)],
                                mem_total_bytes=80 * 2**30, host="gpu-host", device=0, ts=time.time())
    envs, said = [], []
    for d in decisions:
        env, enforced, message = start_environment(d, visible=(0,), environ=mps_env)
        envs.append(env)
        said.append({"job": d.details["job"], "sm_percent": d.details["sm_percent"], "enforced": enforced,
                     "message": message})
    report["shares"] = said
    report["both_under_shares"] = measured(envs, args.seconds)
    if ctl:
        subprocess.run([ctl], input="quit\n", env={**os.environ, **mps_env}, capture_output=True, text=True,
                       timeout=30)
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mps_shares.json"), "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
