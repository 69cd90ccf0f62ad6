"""Rebuild the phase models phasewise ships pretrained (run from the repository root).

    .venv/bin/python src/phasewise/data/make_pretrained.py

``corpus_cpu_mem.pwck`` (the default start of a live worker, ``phase_pretrained_model corpus``): the
same training on the TRAIN split of the shipped corpus (``corpus/``: 30 real executions of five kinds of
training job recorded here at 1 s; the held-out runs and the held-out kind are never seen), the
executions one after the other in the order they were recorded.

``ai4dl_cpu_mem.pwck`` (``phase_pretrained_model ai4dl``):

Trains a shared :class:`~phasewise.models.phases.detector.PhaseModel` (cpu, mem) on
ALL FOUR containers of ``ai4dl_sample.csv`` (the Apache-2.0 AI4DL IBM DLaaS
sample) with :func:`phasewise.apps.replay.driving.pretrain_model`: the containers are
stepped through a learning ``PhaseFleet`` in event-time order, in as many
passes as the CRBM needs to see 1024 windows; both the absolute and the
relative (usage / container level, decaying-max level with a 30-sample
half-life) per-phase statistics are credited. Deterministic (seed 0).

Because it saw every container of the sample, scoring it on that sample
would score it on its training data: ``phasewise replay`` never uses it
(``--pretrain-folds`` trains fold models on the other containers instead);
it is what a live worker or a new trace starts from.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from phasewise.apps.replay.driving import FleetOptions, pretrain_model
from phasewise.apps.replay.traces import Trace, load_trace

HERE = Path(__file__).resolve().parent


def corpus_train_trace() -> Trace:
    """The shipped corpus's train-split executions as one trace (cpu, mem; one container per execution)."""
    from phasewise.apps.experiment.corpus_models import train_trace
    from phasewise.apps.experiment.corpus_prior import split_series

    train, _, series = split_series(HERE / "corpus", "train")
    return train_trace(series, train)


def main() -> int:
    for name, trace in (("ai4dl_cpu_mem.pwck", load_trace(HERE / "ai4dl_sample.csv", "ai4dl")),
                        ("corpus_cpu_mem.pwck", corpus_train_trace())):
        model = pretrain_model(trace, FleetOptions())
        data = model.to_bytes()
        out = HERE / name
        out.write_bytes(data)
        print(f"{out}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}, ready={model.ready}, "
              f"phases {model.clusterer.phase_ids}, CRBM windows seen {model.crbm.n_seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
