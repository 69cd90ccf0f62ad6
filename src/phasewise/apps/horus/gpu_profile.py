"""Profile the catalog's models training on one CUDA GPU: mean GPU utilisation (NVML, every 50 ms) and the
most GPU memory used, each job for a few seconds after a warm-up, on synthetic batches of its dataset's
shape (no input pipeline); AMP is float16 autocast. One process; a row is written as soon as it is measured:
``python -m phasewise.apps.horus.gpu_profile OUT.csv [SECONDS WARMUP]``. docs/horus.md, "Results".
"""

import csv
import sys
import threading
import time

import torch

from phasewise.models.horus.catalog import DATASETS, MODELS
from phasewise.models.horus.graph_features import inputs_for
from phasewise.models.horus.zoo import build, input_kind, optimizer

#: catalog model -> batch sizes profiled (small, usual, large for its dataset)
B = dict(resnet18=(32, 128, 512), resnet50=(16, 64, 128), vgg16=(32, 128, 512), vgg19=(32, 128, 512),
         mobilenet_v2=(32, 128, 512), mobilenet_v3=(32, 128, 512), efficientnet_b0=(16, 64, 128),
         bert_base=(4, 16, 32), lstm_lm=(20, 80, 320), transformer=(32, 128, 512), dcgan=(64, 256, 512),
         neumf=(256, 2048, 16384), pointnet=(16, 64, 128), ppo_mlp=(64, 1024, 8192), td3_mlp=(100, 1024, 8192))


def job(key, batch, amp, seconds, warmup, h):
    import pynvml

    d = DATASETS[MODELS[key]]
    net = build(key, d).cuda()
    P = net.parameters()
    opt = torch.optim.Adam(P, 1e-4) if optimizer(key) == "adam" else torch.optim.SGD(P, 0.01, momentum=0.9)
    sc = torch.amp.GradScaler(enabled=amp)
    k = input_kind(key)
    hi = {"tokens": (d.vocab,), "seq2seq": (d.vocab, d.tgt_vocab), "ratings": (d.users, d.items)}.get(k)
    xs = [torch.randn(x.shape) if x.is_floating_point() else torch.randint(0, hi[i], x.shape)
          for i, x in enumerate(inputs_for(k, d, batch, "cpu"))]
    xs = [x.cuda() for x in xs]
    u, m, stop = [], [], threading.Event()

    def sample():
        while not stop.wait(0.05):
            u.append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            m.append(pynvml.nvmlDeviceGetMemoryInfo(h).used)

    th = threading.Thread(target=sample)
    n, t0, t = 0, time.time(), 0
    while not t or time.time() - t < seconds:
        with torch.autocast("cuda", torch.float16, enabled=amp):
            out = net(*xs)
            loss = sum(o.float().pow(2).mean() for o in (out if isinstance(out, tuple) else (out,)))
        opt.zero_grad()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        n += 1
        if not t and time.time() - t0 > warmup:
            torch.cuda.synchronize()
            t, n0 = time.time(), n
            th.start()
    torch.cuda.synchronize()
    stop.set()
    th.join()
    return sum(u) / len(u), max(m) / 2**20, (time.time() - t) / (n - n0)


def main(path, seconds=2.0, warmup=1.0):
    import pynvml  # nvidia-ml-py: where a GPU is

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    gpu = torch.cuda.get_device_name()
    with open(path, "w") as fh:
        w = csv.writer(fh)
        w.writerow(["model", "dataset", "batchsize", "amp", "gpu_util", "gmem", "step_s", "device", "gpu"])
        for key, bs in B.items():
            for b in bs:
                for amp in (False, True):
                    try:
                        r = job(key, b, amp, seconds, warmup, h)
                    except Exception as e:  # noqa: BLE001 - a job that fails is left out, and said
                        print(key, b, amp, repr(e)[:200], flush=True)
                        continue
                    finally:
                        torch.cuda.empty_cache()
                    w.writerow([key, MODELS[key], b, ["false", "true"][amp], round(r[0], 1), round(r[1]),
                                round(r[2], 5), gpu.split()[1].lower(), gpu])
                    fh.flush()
                    print(key, b, amp, *r, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *map(float, sys.argv[2:]))
