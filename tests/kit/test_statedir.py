"""State directories: the default is never /tmp, a missing one is created private, a tampered one is refused,
and the roles stop on one at start-up (one line, exit status 2) before they write anything."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from phasewise.kit.settings import Settings
from phasewise.kit.statedir import ROOT_STATE_DIR, StateDirError, default_data_dir, ensure_state_dir
from tests.conftest import requires_root

NOBODY = 65534


def mode_of(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_the_default_is_var_lib_for_root_and_the_users_state_directory_otherwise():
    assert default_data_dir(0, {"XDG_STATE_HOME": "/x"}) == ROOT_STATE_DIR
    assert default_data_dir(1000, {"XDG_STATE_HOME": "/home/u/st", "HOME": "/home/u"}) == "/home/u/st/phasewise"
    assert default_data_dir(1000, {"HOME": "/home/u"}) == "/home/u/.local/state/phasewise"
    assert default_data_dir(1000, {"XDG_STATE_HOME": "st", "HOME": "/home/u"}) == "/home/u/.local/state/phasewise"
    assert not Settings().data_dir.startswith("/tmp")
    assert Settings().data_dir == default_data_dir()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o000])
@pytest.mark.parametrize("mode", [0o700, 0o711])
def test_a_missing_directory_and_its_parents_are_created_with_the_mode_asked_whatever_the_umask(tmp_path, umask,
                                                                                                 mode):
    target = tmp_path / "a" / "b" / "state"
    old = os.umask(umask)
    try:
        got = ensure_state_dir(target, mode=mode)
    finally:
        os.umask(old)
    assert got == target and target.is_dir() and mode_of(target) == mode
    assert ensure_state_dir(target, mode=mode) == target  # a second start takes it as it is


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o711, 0o755])
def test_an_existing_directory_no_one_else_may_write_is_taken_and_keeps_its_mode(tmp_path, mode):
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, mode)
    ensure_state_dir(d)
    assert mode_of(d) == mode


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o777, 0o1777])
def test_a_directory_group_or_others_may_write_is_refused(tmp_path, mode):
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(StateDirError, match=rf"is writable by group or others \(mode 0?{mode:o}\); chmod go-w it"):
        ensure_state_dir(d)
    assert mode_of(d) == mode  # refused, not repaired behind the operator's back


def test_a_symbolic_link_is_refused_even_to_a_good_directory(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "state"
    link.symlink_to(real)
    with pytest.raises(StateDirError, match="is a symbolic link"):
        ensure_state_dir(link)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(StateDirError, match="is a symbolic link"):
        ensure_state_dir(dangling)
    assert not (tmp_path / "nowhere").exists()  # not created through the link


def test_a_file_is_refused(tmp_path):
    f = tmp_path / "state"
    f.write_text("")
    with pytest.raises(StateDirError, match="is not a directory"):
        ensure_state_dir(f)


@requires_root
def test_a_directory_another_user_owns_is_refused(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(StateDirError, match=r"is owned by uid 65534 \(nobody\), not by uid 0 \(root\)"):
        ensure_state_dir(d)
    # and the other way round: the role's user is the one that counts
    assert ensure_state_dir(d, uid=NOBODY) == d


@requires_root
def test_a_directory_below_one_another_user_owns_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(StateDirError, match=r"lies below .*theirs, a directory owned by uid 65534"):
        ensure_state_dir(theirs / "state")
    assert not (theirs / "state").exists()
    # a link another user made on the way
    good = tmp_path / "good"
    good.mkdir()
    link = tmp_path / "via"
    link.symlink_to(good)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(StateDirError, match=r"a link owned by uid 65534"):
        ensure_state_dir(link / "state")


# --------------------------------------------------------------------------- the roles at start-up


def run_role(role: str, data_dir, *args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")},
           "PHASEWISE_DATA_DIR": str(data_dir), "PHASEWISE_BOOTSTRAP": "127.0.0.1:1"}
    return subprocess.run([sys.executable, "-m", "phasewise.cli", role, *args], env=env, capture_output=True,
                          text=True, timeout=120)


def planted(tmp_path):
    """A data dir another local user made first (world-writable, theirs), a job log linked to a root file."""
    d = tmp_path / "phasewise"
    (d / "jobs").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    (d / "jobs" / "job-a.log").symlink_to(victim)
    for p in (d, d / "jobs"):
        os.chmod(p, 0o1777)
    if os.geteuid() == 0:
        for p in (d, d / "jobs"):
            os.chown(p, NOBODY, NOBODY)
    return d, victim


@pytest.mark.parametrize("role,args", [
    ("actuate", ["--backend", "dry-run"]),
    ("worker", []),
    ("horus", []),
    ("place", []),
])
def test_every_role_stops_on_a_planted_data_dir_in_one_line_before_writing_anything(tmp_path, role, args):
    d, victim = planted(tmp_path)
    before = sorted(p.name for p in d.rglob("*"))
    r = run_role(role, d, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"phasewise {role}: error: data_dir: {d}"), line
    assert ("owned by uid 65534" if os.geteuid() == 0 else "writable by group or others") in line
    assert sorted(p.name for p in d.rglob("*")) == before and victim.read_text() == "root's file\n"


@requires_root
def test_the_demo_stops_on_a_planted_data_dir(tmp_path):
    d, victim = planted(tmp_path)
    r = run_role("demo", d, "--duration", "1")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().startswith(f"phasewise demo: error: data_dir: {d} is owned by uid 65534"), r.stderr
    assert victim.read_text() == "root's file\n"
