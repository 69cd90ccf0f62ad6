"""``phasewise bench fuzz``: hostile messages at the real roles through Kafka (their own embedded broker)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phasewise.apps.bench.fuzz import KINDS


def fuzz(*argv: str, timeout_s: float = 600) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "phasewise.cli", "bench", "fuzz", *argv, "--json"],
                       capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, p.stdout[-2000:] + p.stderr[-4000:]
    return p.returncode, json.loads(lines[-1])


def test_the_decoder_check_needs_no_broker_and_counts_every_kind():
    rc, out = fuzz("--topic", "samples", "--messages", "3000", "--decoders-only", "--seed", "5")
    assert rc == 0, out
    assert out["rejected_with_reason"] == 3000 and out["decoder_crashes"] == 0 and out["generator_valid"] == {}
    assert set(out["kinds"]) == set(KINDS["samples"])


def test_every_valid_sample_is_stamped_in_the_past_however_many_messages():
    import time

    from phasewise.apps.bench.fuzz import Fuzzer
    from phasewise.kit.records import HostSamples, decode

    n = 20000  # the worker refuses samples stamped more than intake_max_future_s (300 s) ahead of its clock
    fz = Fuzzer("samples", 0, messages=n)
    assert decode(HostSamples, fz.valid(n - 1)[1]).ts < time.time() - 3000
    assert decode(HostSamples, fz.valid(0)[1]).ts > time.time() - 3600 - n - 60


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("topic,policy", [("samples", "vpa"), ("samples", "phase"), ("decisions", "vpa"),
                                          ("learn-windows", "phase"), ("models", "phase")])
def test_every_hostile_message_is_dead_lettered_and_no_valid_one_is_lost(topic, policy):
    rc, out = fuzz("--topic", topic, "--policy", policy, "--messages", "250", "--valid-every", "5", "--seed", "9")
    assert out["messages"] == 250 and out["valid"] == 50
    assert out["dead_lettered"] == 250 and out["not_dead_lettered"] == 0, out
    assert out["valid_handled"] == 50 and out["valid_lost"] == 0 and out["valid_dead_lettered"] == 0, out
    assert out["crashes"] == 0 and out["exit_code"] == 0 and out["decoder_crashes"] == 0, out
    assert rc == 0


@pytest.mark.broker
def test_a_bench_ended_by_sigterm_stops_the_broker_and_roles_it_started():
    import signal
    import time

    import psutil

    p = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "bench", "fuzz", "--topic", "samples",
                          "--messages", "100000", "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        me = psutil.Process(p.pid)
        deadline = time.monotonic() + 120
        started: list[psutil.Process] = []
        while time.monotonic() < deadline and p.poll() is None:  # its broker and its worker are up
            started = me.children(recursive=True)
            if any("tansu" in " ".join(c.cmdline()) for c in started) and \
                    any("worker" in c.cmdline() for c in started):
                break
            time.sleep(0.2)
        assert p.poll() is None and len(started) >= 2, p.stderr.read().decode()[-2000:] if p.stderr else ""
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], [c.cmdline() for c in alive]
    finally:
        if p.poll() is None:
            p.kill()
