"""``phasewise bench flood`` end to end on a small fleet (its own embedded broker): the README's memory command
at a size the suite can afford. It reads the worker's memory only once every container's state is written and
the heap trimmed; the cap refuses the containers beyond it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_every_state_is_written_before_memory_is_read_and_the_cap_refuses_the_rest():
    env = {**os.environ, "PHASEWISE_HEAP_TRIM_INTERVAL_S": "1"}
    r = subprocess.run([sys.executable, "-m", "phasewise.cli", "bench", "flood", "--containers", "2000",
                        "--per-message", "500", "--beyond", "500", "--json"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["policy"] == "vpa" and out["heap_trim_interval_s"] == 1.0
    assert out["containers_held"] == 2000 and out["table_writes"] >= 2000
    assert out["containers_refused"] + out["containers_evicted"] >= 500
    assert out["rss_bytes"] > out["rss_idle_bytes"] > 0
