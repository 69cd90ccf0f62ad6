"""Clear errors from the real CLI: one line, the right exit status, no traceback.

Every case runs ``python -m phasewise.cli ROLE ...`` in a subprocess with a
clean ``PHASEWISE_*`` environment and the bootstrap address of a port nothing
listens on.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phasewise.kit.broker import free_port
from phasewise.kit.command import add_setting, arg_type
from phasewise.kit.settings import SPECS, Settings, SettingsError, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = str(ROOT / "infra" / "schemas")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    env["PHASEWISE_BOOTSTRAP"] = f"127.0.0.1:{free_port()}"  # nothing listens there
    env.update(extra)
    return env


def cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phasewise.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


#: (role and flags, environment, what the one line says after "phasewise ROLE: error: ")
BAD = [
    # the environment, one of each kind of value
    (["topics"], {"PHASEWISE_SESSION_TIMEOUT_MS": "abc"}, "PHASEWISE_SESSION_TIMEOUT_MS: 'abc' is not an integer"),
    (["produce"], {"PHASEWISE_INTERVAL_S": "-1"}, "PHASEWISE_INTERVAL_S: must be > 0, got -1.0"),
    (["produce"], {"PHASEWISE_INTERVAL_S": "1s"}, "PHASEWISE_INTERVAL_S: '1s' is not a number"),
    (["worker"], {"PHASEWISE_HYSTERESIS": "nan"}, "PHASEWISE_HYSTERESIS: 'nan' is not a finite number"),
    (["actuate"], {"PHASEWISE_CPU_FLOOR_CORES": "inf"}, "PHASEWISE_CPU_FLOOR_CORES: 'inf' is not a finite number"),
    (["actuate"], {"PHASEWISE_BACKEND": "xyz"}, "PHASEWISE_BACKEND: invalid choice: 'xyz'"),
    (["actuate"], {"PHASEWISE_MEM_MARGIN_BYTES": "lots"}, "PHASEWISE_MEM_MARGIN_BYTES: 'lots' is not a size"),
    (["actuate"], {"PHASEWISE_APPLY_RETRIES": "-2"}, "PHASEWISE_APPLY_RETRIES: must be >= 0, got -2"),
    (["worker"], {"PHASEWISE_CREATE_TOPICS": "maybe"}, "PHASEWISE_CREATE_TOPICS: 'maybe' is not a boolean"),
    (["worker"], {"PHASEWISE_PHASE_FEATURES": "cpu,tpu"}, "PHASEWISE_PHASE_FEATURES: unknown feature(s) tpu"),
    (["worker"], {"PHASEWISE_WEB_PORT": "70000"}, "PHASEWISE_WEB_PORT: must be in [0, 65535], got 70000"),
    (["worker"], {"PHASEWISE_HEARTBEAT_INTERVAL_MS": "9000"},
     "PHASEWISE_HEARTBEAT_INTERVAL_MS: must be below session_timeout_ms (6000), got 9000"),
    (["produce"], {"PHASEWISE_CGROUP_PREFIX": "../etc"}, "PHASEWISE_CGROUP_PREFIX: must be a relative path"),
    (["produce"], {"PHASEWISE_CGROUP_LAYOUT": "k8s"}, "PHASEWISE_CGROUP_LAYOUT: invalid choice: 'k8s'"),
    (["actuate"], {"PHASEWISE_WORKLOAD_DEFAULT_MODE": "on"}, "PHASEWISE_WORKLOAD_DEFAULT_MODE: invalid choice: 'on'"),
    (["produce", "--once"], {"PHASEWISE_WORKLOAD_POLICY_FILE": "/nonexistent/policy.json"},
     "workload_policy_file: policy file /nonexistent/policy.json: No such file or directory"),
    (["produce", "--json"], {}, "--json goes with --once"),
    (["actuate"], {"PHASEWISE_WORKLOAD_POLICY_FILE": "/nonexistent/policy.json"},
     "workload_policy_file: policy file /nonexistent/policy.json: No such file or directory"),
    (["topics"], {"PHASEWISE_BOOTSTRAP": ""}, "PHASEWISE_BOOTSTRAP: must not be empty"),
    (["topics"], {"PHASEWISE_BOOTSTRAP": "localhost:9O92"},
     "PHASEWISE_BOOTSTRAP: 'localhost:9O92': the port '9O92' is not a number in 1..65535"),
    (["produce", "--bootstrap", "a:9092,[::1]:x"], {}, "--bootstrap: '[::1]:x': the port 'x' is not a number"),
    # every role checks every setting with a fixed set of values, also those it does not use
    (["schemas", "--check", SCHEMAS], {"PHASEWISE_LOG_LEVEL": "loud"}, "PHASEWISE_LOG_LEVEL: invalid choice: 'loud'"),
    (["replay", "--policies", "window"], {"PHASEWISE_POLICY": "oracle"}, "PHASEWISE_POLICY: invalid choice"),
    (["bench", "phases", "--pure-only"], {"PHASEWISE_PHASE_STATISTICS": "median"},
     "PHASEWISE_PHASE_STATISTICS: invalid choice"),
    (["demo", "--duration", "1"], {"PHASEWISE_VPA_UPDATE_MODE": "sometimes"},
     "PHASEWISE_VPA_UPDATE_MODE: invalid choice"),
    (["broker", "--no-topics"], {"PHASEWISE_BACKEND": "cgroups"}, "PHASEWISE_BACKEND: invalid choice: 'cgroups'"),
    # flags
    (["topics", "--partitions", "x"], {}, "--partitions: 'x' is not an integer"),
    (["worker", "--hysteresis", "nan"], {}, "--hysteresis: 'nan' is not a finite number"),
    (["worker", "--hysteresis", "1.5"], {}, "--hysteresis: must be in [0, 1), got 1.5"),
    (["produce", "--interval", "-1"], {}, "--interval: must be > 0, got -1.0"),
    (["worker", "--policy", "xyz"], {}, "--policy: invalid choice: 'xyz'"),
    (["actuate", "--backend", "xyz"], {}, "--backend: invalid choice: 'xyz'"),
    (["actuate", "--mem-margin", "lots"], {}, "--mem-margin: 'lots' is not a size"),
    (["worker", "--bogus"], {}, "unrecognized arguments: --bogus"),
    (["broker", "--port", "0"], {}, "--port: must be in [1, 65535], got 0"),
    (["broker", "--log-level", "loud"], {}, "--log-level: invalid choice: 'loud'"),
    (["demo", "--duration", "-1"], {}, "--duration: must be > 0, got -1.0"),
    (["demo", "--interval", "nan"], {}, "--interval: 'nan' is not a finite number"),
    (["replay", "--windows", "0"], {}, "--windows: must be positive integers"),
    (["replay", "--phase-quantile", "nan"], {}, "--phase-quantile: 'nan' is not a finite number"),
    (["replay", "--phase-stats", "median"], {}, "--phase-stats: invalid choice: 'median'"),
    (["replay", "--pretrain-folds", "1"], {}, "--pretrain-folds: must be 0 (no pretraining) or at least 2 folds"),
    (["bench", "phases", "--features", "cpu"], {}, "--features: must hold cpu,mem"),
    (["bench", "pipeline", "--seconds", "inf"], {}, "--seconds: 'inf' is not a finite number"),
    (["schemas", "--write", "/proc/phasewise-schemas"], {}, "--write: No such file or directory"),
    # --report DIR: refused before any work, not after the run
    (["replay", "--report", "/proc/phasewise-report"], {}, "--report: cannot write a report in /proc/phasewise-report"),
    (["simulate", "--report", str(ROOT / "README.md")], {}, f"--report: {ROOT / 'README.md'} is not a directory"),
    (["experiment", "priorities", "--report", "/proc/x/y"], {}, "--report: cannot write a report in /proc/x/y"),
    (["experiment", "targets", "--report", "/proc/x"], {}, "--report: cannot write a report in /proc/x"),
    # key files, read when the role starts
    (["actuate"], {"PHASEWISE_SIGNING_KEY_FILE": "/proc/no-such-key"}, "signing_key_file: cannot read"),
    (["worker"], {"PHASEWISE_SIGNING_KEY_FILE": "/proc/no-such-key"}, "signing_key_file: cannot read"),
    (["actuate"], {"PHASEWISE_SIGNING_PREVIOUS_KEY_FILE": "/proc/no-such-key"},
     "signing_previous_key_file: set without signing_key_file"),
    (["place"], {"PHASEWISE_SIGNING_KEY_FILE": "/proc/no-such-key"}, "signing_key_file: cannot read"),
    (["horus"], {"PHASEWISE_SIGNING_KEY_FILE": "/proc/no-such-key"}, "signing_key_file: cannot read"),
    (["actuate"], {"PHASEWISE_JOB_TRUSTED_SUBMITTERS": "/proc/no-such-keys"},
     "job_trusted_submitters: cannot read /proc/no-such-keys: No such file or directory"),
    (["actuate"], {"PHASEWISE_JOB_TRUSTED_SUBMITTERS": "/proc/self/fd"},
     "job_trusted_submitters: no public key in /proc/self/fd"),
    (["actuate", "--start-jobs"], {}, "actuator_start_jobs is on but job_trusted_submitters is empty"),
    (["actuate"], {"PHASEWISE_JOB_ALLOWED_COMMANDS": "/usr/bin/python3,python"},
     "PHASEWISE_JOB_ALLOWED_COMMANDS: 'python' is not an absolute path"),
]


def _id(case: tuple) -> str:
    args, env, _ = case
    return " ".join([*(f"{k}={v}" for k, v in env.items()), *args])


@pytest.mark.parametrize("args, env, says", BAD, ids=[_id(c) for c in BAD])
def test_a_configuration_error_is_one_line_and_exit_status_2(args, env, says):
    r = cli(args, clean_env(**env))
    lines = r.stderr.splitlines()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stdout == "", "nothing starts on a configuration error"
    assert len(lines) == 1, r.stderr
    # "phasewise bench phases: error: ..." for a flag of the bench's own sub-command
    assert re.match(rf"phasewise {args[0]}( [a-z]+)?: error: ", lines[0]), lines[0]
    assert says in lines[0]


@pytest.mark.parametrize("args", [["bench", "--help"], ["predict", "--help"], ["predict", "eval", "--help"]])
def test_help_comes_without_importing_torch(args):
    code = f"import sys; from phasewise.cli import main; rc = main({args!r}); print('torch' in sys.modules, rc)"
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.stdout.splitlines()[-1] == "False 0", r.stderr
    assert "usage: phasewise" in r.stdout


@pytest.mark.parametrize("role", ["worker", "horus", "place"])
def test_a_key_file_that_cannot_be_used_stops_a_worker_role_before_its_models_are_imported(role):
    """The one-line error comes before Faust, torch and river are loaded (seconds of CPU on a busy host)."""
    code = (f"import sys; from phasewise.cli import main; rc = main([{role!r}]); "
            "print(sorted(m for m in ('faust', 'torch', 'river') if m in sys.modules), rc)")
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(PHASEWISE_SIGNING_KEY_FILE="/proc/no-such-key"),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.stdout.splitlines()[-1] == "[] 2", r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"phasewise {role}: error: signing_key_file: cannot read /proc/no-such-key: "
                                     "No such file or directory"]


def test_an_unknown_phasewise_variable_is_a_one_line_warning_naming_the_closest_setting():
    r = cli(["schemas", "--check", SCHEMAS], clean_env(PHASEWISE_BOOTSTRP="kafka:9092"))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["phasewise schemas: warning: PHASEWISE_BOOTSTRP is not a setting and is "
                                     "ignored (did you mean PHASEWISE_BOOTSTRAP?)"]


def test_the_environment_takes_the_units_and_forms_of_the_flags():
    env = clean_env(PHASEWISE_MEM_MARGIN_BYTES="64Mi", PHASEWISE_MEM_FLOOR_BYTES="1G",
                    PHASEWISE_CREATE_TOPICS="off", PHASEWISE_LOG_LEVEL="warning")
    r = cli(["schemas", "--check", SCHEMAS], env)  # every role reads and checks the whole environment
    assert r.returncode == 0 and r.stderr == "", r.stderr
    s = Settings.from_env(env=env)
    assert (s.actuator.mem_margin_bytes, s.actuator.mem_floor_bytes,
            s.kafka.create_topics) == (64 * 2**20, 10**9, False)


@pytest.mark.parametrize("name", sorted(n for n, s in SPECS.items() if s.kind != "bool"))
def test_a_setting_reads_a_text_the_same_from_the_environment_and_its_flag(name):
    spec = SPECS[name]
    flag = argparse.ArgumentParser()
    add_setting(flag, name)
    default = Settings().get(name)
    if spec.kind == "int":
        texts = [str(default), "abc", "-1", "1.5"]
        if spec.parse.__name__ == "parse_size":
            texts += ["64Mi", "1.5G", "lots"]
    elif spec.kind == "float":
        texts = [repr(float(default)), "nan", "inf", "-1", "x"]
    else:
        texts = [default, "", "no-such-value"]
    for text in texts:
        try:
            from_env = Settings.from_env(env={spec.env: text})
        except SettingsError as e:
            assert e.setting == spec.env and "\n" not in str(e)
            with pytest.raises(SystemExit):  # argparse refuses it too
                flag.parse_args([spec.flag or "--" + name.replace("_", "-"), text])
            continue
        ns = flag.parse_args([spec.flag or "--" + name.replace("_", "-"), text])
        assert getattr(ns, name) == from_env.get(name), text


def test_the_choices_are_defined_once_for_argparse_and_the_environment():
    for name, spec in SPECS.items():
        if spec.choices is None:
            continue
        p = argparse.ArgumentParser()
        action = add_setting(p, name)
        assert tuple(action.choices) == spec.choices
        for c in spec.choices:
            assert Settings.from_env(env={spec.env: c}).get(name) == c
        with pytest.raises(SettingsError, match="invalid choice"):
            Settings.from_env(env={spec.env: "no-such-choice"})


def test_direct_construction_is_checked_too():
    with pytest.raises(SettingsError, match=r"^hysteresis: must be a finite number, got nan$"):
        WorkerSettings(hysteresis=float("nan"))
    with pytest.raises(SettingsError, match="interval_s: must be > 0"):
        Settings.from_env({"interval_s": 0}, env={})
    assert arg_type(SPECS["interval_s"].parse, SPECS["interval_s"].validate)("2") == 2.0


def test_topics_without_a_broker_says_so_in_one_line_and_exits_1():
    env = clean_env()
    t0 = time.monotonic()
    r = cli(["topics", "--timeout", "2"], env)
    assert r.returncode == 1, r.stderr
    assert time.monotonic() - t0 < 30
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [f"phasewise topics: no Kafka broker answered at {env['PHASEWISE_BOOTSTRAP']} "
                                     "within 2 s (Connection refused)"]


# --------------------------------------------------------------------------- no broker, then a signal

NO_BROKER = re.compile(r"WARNING phasewise\.kafka\.client: no Kafka broker answers at (\S+) \((.+)\)")


def _role_args(role: str, tmp_path: Path) -> list[str]:
    if role == "produce":
        cg = tmp_path / "cgroup"
        (cg / "phasewise").mkdir(parents=True)
        (cg / "cgroup.controllers").write_text("cpu memory\n")
        return ["produce", "--interval", "0.5", "--cgroup-root", str(cg)]
    if role == "actuate":
        return ["actuate", "--backend", "dry-run", "--cgroup-root", str(tmp_path / "none")]
    return ["worker", "--web-port", "0"]


@pytest.mark.slow
@pytest.mark.parametrize("role", ["produce", "actuate", "worker"])
def test_a_role_without_a_broker_says_so_every_few_seconds_and_stops_soon_after_sigint(role, tmp_path):
    env = clean_env(PHASEWISE_DATA_DIR=str(tmp_path / "data"))
    log_path = tmp_path / f"{role}.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "phasewise.cli", *_role_args(role, tmp_path)], env=env,
                             stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 90
        while len(NO_BROKER.findall(log_path.read_text())) < 2:  # the first line, then a repeat ~5 s later
            assert p.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "no repeated no-broker line:\n" + log_path.read_text()
            time.sleep(0.2)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
        stopped_s = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = log_path.read_text()
    assert rc == 0, text
    # at once, not after a connect timeout (30 s): the bound leaves room for a loaded machine's slow exit
    assert stopped_s < 20.0, f"stopped {stopped_s:.1f} s after SIGINT"
    said = NO_BROKER.findall(text)
    assert {addr for addr, _ in said} == {env["PHASEWISE_BOOTSTRAP"]}
    assert {why for _, why in said} == {"Connection refused"}
    times = [time.mktime(time.strptime(m, "%Y-%m-%d %H:%M:%S")) for m in
             re.findall(r"^(\S+ \S+),\d+ WARNING phasewise\.kafka\.client: no Kafka", text, re.M)]
    assert all(b - a >= 4 for a, b in zip(times, times[1:])), "rate-limited: at most one line per ~5 s"
    assert "%3|" not in text and "FAIL|rdkafka" not in text, "no raw librdkafka lines"
    assert "Traceback" not in text
    assert len(text.splitlines()) < 20, text


@pytest.mark.broker
@pytest.mark.slow
def test_a_worker_whose_broker_goes_away_logs_little_and_stops_soon_after_sigint(tmp_path):
    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import EmbeddedBroker

    broker = EmbeddedBroker(log_path=tmp_path / "tansu.log").start()
    metrics_port = free_port()
    env = clean_env(PHASEWISE_BOOTSTRAP=broker.bootstrap, PHASEWISE_DATA_DIR=str(tmp_path / "data"))
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "worker", "--web-port", "0", "--metrics-port",
                              str(metrics_port), "--worker-id", f"pwtest-outage-{free_port()}"],
                             env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "worker not ready:\n" + log_path.read_text()
            try:
                if scrape(f"http://127.0.0.1:{metrics_port}/metrics").get("phasewise_worker_ready") == 1.0:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        broker.stop()
        before = len(log_path.read_text().splitlines())
        time.sleep(15)
        during = log_path.read_text().splitlines()[before:]
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
        stopped_s = time.monotonic() - t0
    finally:
        broker.stop()
        if p.poll() is None:
            p.kill()
            p.wait()
    text = "\n".join(during)
    assert len(during) < 40, f"{len(during)} lines in 15 s without a broker:\n{text}"
    assert "Traceback" not in text and "Logging error" not in text
    assert any("more like this" in ln for ln in during), "aiokafka's repeated lines are folded"
    # the unreachable-broker watchdog (3 s), not STOP_GRACE_S (60 s); room for a loaded machine's slow exit
    assert stopped_s < 20.0, f"stopped {stopped_s:.1f} s after SIGINT:\n" + log_path.read_text()[-3000:]
    assert rc in (0, 1)


def test_every_flag_a_setting_declares_is_taken_by_a_role():
    # a flag the reference (docs/configuration.md) lists but no role's parser takes is "unrecognized arguments"
    from phasewise.cli import build_parser
    from phasewise.kit.settings import SPECS

    parser = build_parser("*")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    taken = {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}
    assert sorted(n for n, s in SPECS.items() if s.flag and s.flag not in taken) == []
