"""Exact recovery: a real worker SIGKILLed several times mid-stream decides, record by record,
what the same logic decides in process without a kill (``--policy vpa``, state written at every commit).

The run is :func:`phasewise.apps.bench.recovery.run_once` (``phasewise bench recovery`` repeats it):
240 ticks of 4 hosts x 6 containers produced while the worker is killed and restarted, every
distinct decision id published compared with the unkilled reference.
"""

from __future__ import annotations

import pytest

from tests.conftest import private_broker_fixture

pytestmark = [pytest.mark.broker, pytest.mark.slow]

broker = private_broker_fixture()  # the worker reads the samples topic from its start


def test_three_sigkills_mid_stream_give_the_unkilled_run_s_decisions(broker, tmp_path):
    from phasewise.apps.bench.recovery import run_once
    from phasewise.kit.kafka.client import ensure_topics
    from phasewise.kit.settings import Settings

    ensure_topics(Settings.from_env({"bootstrap": broker.bootstrap}, env={}))
    r = run_once(broker.bootstrap, tmp_path, kills=3, state_write_interval_s=0.0)
    assert r["reference"] > 30  # the scenario decides enough to compare
    assert (r["missing"], r["extra"]) == (0, 0), r
    assert r["published"] == r["reference"], r
