"""Submitter signatures on jobs (phasewise.kit.job_signing), pure: what is signed, key files, the trusted set, rotation.

Each signed field changed in turn breaks the signature; key files that are missing, too open, of another kind or
not keys are one-line errors; a trusted set of files and directories takes several keys, and is read again when a
file is added, removed or replaced. The CLI writes a key pair and never overwrites one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from phasewise.kit.job_signing import (
    JobSigningError,
    SubmitterKeys,
    key_id,
    load_private_key,
    load_public_key,
    sign_event,
    sign_job,
    spec_digest,
    spec_of,
    start_details,
    write_key_pair,
)
from phasewise.kit.records import JobEvent, JobRequests, JobTargets, decode, encode
from tests.job_keys import KEY, STRANGER, spec, submitted, write_private, write_public

ROOT = Path(__file__).resolve().parents[2]
TS = 1_700_000_000.25
SPEC = spec(("/usr/bin/python3", "train.py"), requests=JobRequests(cpu_cores=2.0, mem_bytes=2**30),
            targets=JobTargets(objective=0.1), node_selector={"gpu": "a100"})
KEYS = SubmitterKeys.of([KEY.public_key()])


def test_a_signature_verifies_and_survives_the_topic():
    sig = sign_job(KEY, "j1", TS, "training", 3, SPEC)
    assert re.fullmatch(r"ed25519:[0-9a-f]{8}:[A-Za-z0-9+/]{86}==", sig) and sig.split(":")[1] == key_id(
        KEY.public_key())
    assert KEYS.verify("j1", TS, "training", 3, SPEC, sig) is None
    # through the topic: the event as published, decoded again, still verifies (numbers normalised alike)
    ev = submitted("j1", ("/usr/bin/python3", "x"), ts=1700000000, priority=2, requests=JobRequests(cpu_cores=2))
    back = decode(JobEvent, encode(ev))
    assert back.signature == ev.signature and KEYS.verify_event(back) is None
    d = start_details(back)
    assert KEYS.verify_digest(d["job"], d["job_ts"], d["workload"], d["priority"], spec_digest(spec_of(d["spec"])),
                              d["job_signature"]) is None


SPEC_CHANGES = {
    "command": dict(command=("/bin/sh", "-c", "evil")),
    "an argument": dict(command=("/usr/bin/python3", "train.py ")),
    "requests": dict(requests=JobRequests(cpu_cores=64.0, mem_bytes=2**30)),
    "targets": dict(targets=JobTargets(objective=0.2)),
    "node selector": dict(node_selector={"gpu": "h100"}),
    "model": dict(model="resnet50"),
    "batch": dict(batch_size=9),
    "amp": dict(amp=True),
}


@pytest.mark.parametrize("what", list(SPEC_CHANGES))
def test_any_change_to_the_spec_breaks_the_signature(what):
    sig = sign_job(KEY, "j1", TS, "training", 0, SPEC)
    changed = dataclasses.replace(SPEC, **SPEC_CHANGES[what])
    assert spec_digest(changed) != spec_digest(SPEC)
    assert KEYS.verify("j1", TS, "training", 0, changed, sig).startswith("wrong job signature")


@pytest.mark.parametrize("field, value", [("job", "j2"), ("ts", TS + 1e-6), ("workload", "inference"),
                                          ("priority", 1)])
def test_any_change_to_the_job_breaks_the_signature(field, value):
    sig = sign_job(KEY, "j1", TS, "training", 0, SPEC)
    args = {"job": "j1", "ts": TS, "workload": "training", "priority": 0, **{field: value}}
    assert KEYS.verify(args["job"], args["ts"], args["workload"], args["priority"], SPEC, sig).startswith(
        "wrong job signature")


def test_unsigned_malformed_and_untrusted_signatures():
    assert "not signed by a submitter" in KEYS.verify("j", TS, "training", 0, SPEC, None)
    assert "malformed" in KEYS.verify("j", TS, "training", 0, SPEC, "ed25519:abc")
    assert "malformed" in KEYS.verify("j", TS, "training", 0, SPEC, "ed25519:00000000:not base64!")
    theirs = sign_job(STRANGER, "j", TS, "training", 0, SPEC)
    why = KEYS.verify("j", TS, "training", 0, SPEC, theirs)
    assert why == (f"signed by submitter key '{key_id(STRANGER.public_key())}', which is not trusted "
                   f"(job_trusted_submitters: {key_id(KEY.public_key())})")
    # a signature moved onto another key id: the trusted key does not verify it
    moved = theirs.replace(key_id(STRANGER.public_key()), key_id(KEY.public_key()))
    assert KEYS.verify("j", TS, "training", 0, SPEC, moved).startswith("wrong job signature")
    with pytest.raises(ValueError, match="only a submitted event"):
        sign_event(KEY, JobEvent(job="j", ts=1.0, kind="progress"))


# --------------------------------------------------------------------------- key files


def test_a_key_pair_is_written_private_0600_and_never_overwritten(tmp_path):
    old = os.umask(0)  # whatever the umask, the private key is 0600
    try:
        kid = write_key_pair(str(tmp_path / "alice"))
    finally:
        os.umask(old)
    assert (tmp_path / "alice").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "alice.pub").stat().st_mode & 0o777 == 0o644
    private, public = load_private_key(str(tmp_path / "alice")), load_public_key(str(tmp_path / "alice.pub"))
    assert key_id(private.public_key()) == key_id(public) == kid
    before = (tmp_path / "alice").read_bytes()
    with pytest.raises(JobSigningError, match="alice exists: a key file is never overwritten"):
        write_key_pair(str(tmp_path / "alice"))
    assert (tmp_path / "alice").read_bytes() == before
    (tmp_path / "bob.pub").write_text("x")  # only the public half in the way: nothing is written either
    with pytest.raises(JobSigningError, match="bob.pub exists"):
        write_key_pair(str(tmp_path / "bob"))
    assert not (tmp_path / "bob").exists()


def _ec_key():
    return ec.generate_private_key(ec.SECP256R1())


def test_bad_private_key_files_are_one_line_errors(tmp_path):
    ok = write_private(tmp_path / "k")
    assert key_id(load_private_key(str(ok)).public_key()) == key_id(KEY.public_key())
    os.chmod(ok, 0o640)
    cases = {"open": (ok, "readable or writable by group or others (mode 640); chmod 600 it")}
    missing = tmp_path / "missing"
    cases["missing"] = (missing, "cannot read")
    text = tmp_path / "text"
    text.write_text("hello")
    cases["not pem"] = (text, "is not a PEM private key (make one with: phasewise keys submitter")
    ec_file = tmp_path / "ec"
    ec_file.write_bytes(_ec_key().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    cases["ec"] = (ec_file, "not an Ed25519 key")
    enc = tmp_path / "enc"
    enc.write_bytes(KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"pw")))
    cases["encrypted"] = (enc, "is encrypted")
    cases["directory"] = (tmp_path, "is not a regular file")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 70_000)
    cases["huge"] = (big, "a key file is short")
    for name, (path, says) in cases.items():
        if path.is_file() and name != "open":
            os.chmod(path, 0o600)
        with pytest.raises(JobSigningError) as e:
            load_private_key(str(path))
        msg = str(e.value)
        assert msg.startswith("job_submitter_key_file: ") and says in msg and "\n" not in msg, (name, msg)


def test_public_key_files_pem_or_openssh_and_never_writable_by_others(tmp_path):
    pem = write_public(tmp_path / "a.pub")
    ssh = tmp_path / "b.pub"
    ssh.write_bytes(KEY.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b" alice@laptop\n")
    os.chmod(ssh, 0o644)
    assert key_id(load_public_key(str(pem))) == key_id(load_public_key(str(ssh))) == key_id(KEY.public_key())
    os.chmod(pem, 0o666)
    with pytest.raises(JobSigningError, match="writable by group or others .*whoever can write it can add a "
                                              "submitter"):
        load_public_key(str(pem))
    ec_pub = tmp_path / "ec.pub"
    ec_pub.write_bytes(_ec_key().public_key().public_bytes(serialization.Encoding.PEM,
                                                           serialization.PublicFormat.SubjectPublicKeyInfo))
    os.chmod(ec_pub, 0o644)
    with pytest.raises(JobSigningError, match="not an Ed25519 public key"):
        load_public_key(str(ec_pub))
    private = write_private(tmp_path / "p.pub")  # a private key where a public one belongs
    os.chmod(private, 0o644)
    with pytest.raises(JobSigningError, match="is not a public key"):
        load_public_key(str(private))


# --------------------------------------------------------------------------- the trusted set and rotation


def test_the_trusted_set_takes_files_and_directories_of_several_keys(tmp_path):
    d = tmp_path / "submitters"
    d.mkdir(mode=0o755)
    write_public(d / "alice.pub", KEY)
    write_public(d / ".hidden.pub", STRANGER)  # hidden files and other names are not keys of the set
    (d / "README").write_text("not a key")
    single = write_public(tmp_path / "stranger.pub", STRANGER)
    keys = SubmitterKeys.load(f"{d}, {single}")
    assert set(keys.keys) == {key_id(KEY.public_key()), key_id(STRANGER.public_key())}
    assert keys.describe().count(".pub") == 2
    assert len(SubmitterKeys.load(str(d))) == 1 and len(SubmitterKeys.load("")) == 0
    with pytest.raises(JobSigningError, match="^job_trusted_submitters: cannot read /nonexistent"):
        SubmitterKeys.load(f"{d},/nonexistent")
    os.chmod(d, 0o777)
    with pytest.raises(JobSigningError, match="directory .* is writable by group or others"):
        SubmitterKeys.load(str(d))


def test_rotation_add_the_new_key_then_remove_the_old_one(tmp_path):
    d = tmp_path / "submitters"
    d.mkdir(mode=0o755)
    write_public(d / "2024.pub", KEY)
    keys = SubmitterKeys.load(str(d))
    old_sig = sign_job(KEY, "j", TS, "training", 0, SPEC)
    new_sig = sign_job(STRANGER, "j", TS, "training", 0, SPEC)
    assert keys.refresh() is False  # nothing changed: nothing read
    assert keys.verify("j", TS, "training", 0, SPEC, new_sig) is not None
    write_public(d / "2025.pub", STRANGER)  # 1. the new key is added: both are trusted
    assert keys.refresh() is True
    assert keys.verify("j", TS, "training", 0, SPEC, old_sig) is None
    assert keys.verify("j", TS, "training", 0, SPEC, new_sig) is None
    (d / "2024.pub").unlink()  # 2. the old one is removed: its signatures are refused
    assert keys.refresh() is True
    assert "not trusted" in keys.verify("j", TS, "training", 0, SPEC, old_sig)
    assert keys.verify("j", TS, "training", 0, SPEC, new_sig) is None
    # a file replaced in place (another key under the same name) is read again too
    tmp = write_public(d / ".swap", KEY)
    os.replace(tmp, d / "2025.pub")
    assert keys.refresh() is True and keys.verify("j", TS, "training", 0, SPEC, old_sig) is None
    # the whole directory gone: closed until it is back
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    assert keys.refresh() is True and "cannot read" in keys.error and not keys.keys
    assert "the trusted submitters cannot be read" in keys.verify("j", TS, "training", 0, SPEC, old_sig)
    d.mkdir(mode=0o755)
    write_public(d / "back.pub", KEY)
    assert keys.refresh() is True and keys.error is None
    assert keys.verify("j", TS, "training", 0, SPEC, old_sig) is None


# --------------------------------------------------------------------------- the CLI


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    return subprocess.run([sys.executable, "-m", "phasewise.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)})


def test_phasewise_keys_submitter_and_a_signed_submit(tmp_path):
    r = _cli("keys", "submitter", "alice", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    kid = key_id(load_public_key(str(tmp_path / "alice.pub")))
    assert r.stdout.startswith(f"submitter key {kid}: private alice (mode 600")
    r = _cli("keys", "submitter", "alice", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr.splitlines() == [
        "phasewise keys: error: alice exists: a key file is never overwritten (remove it, or choose another path)"]
    job = tmp_path / "job.json"
    job.write_text('{"job": "j1", "model": "resnet18", "dataset": "cifar10", "batch_size": 8, '
                   '"command": ["/usr/bin/python3", "train.py"]}')
    r = _cli("submit", str(job), "--dry-run", "--key", "alice", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    ev = decode(JobEvent, r.stdout)
    assert ev.signature.startswith(f"ed25519:{kid}:")
    assert SubmitterKeys.load(str(tmp_path / "alice.pub")).verify_event(ev) is None
    r = _cli("submit", str(job), "--dry-run", cwd=tmp_path)
    assert r.returncode == 0 and decode(JobEvent, r.stdout).signature is None
    assert r.stderr.splitlines() == ["phasewise submit: warning: job j1 is published unsigned (no --key, "
                                     "job_submitter_key_file empty): it can be placed and predicted, but no "
                                     "actuator starts its command"]
    os.chmod(tmp_path / "alice", 0o644)
    r = _cli("submit", str(job), "--dry-run", "--key", "alice", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr.splitlines() == [
        "phasewise submit: error: job_submitter_key_file: alice is readable or writable by group or others "
        "(mode 644); chmod 600 it"]
