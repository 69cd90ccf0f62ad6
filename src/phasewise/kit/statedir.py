"""A role's state directory (``data_dir``): its default, and refusing one that another user could tamper with.

docs/security.md ("State directories") says why and what is refused.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ROOT_STATE_DIR", "StateDirError", "default_data_dir", "ensure_state_dir"]

#: the default state directory of a role run as root
ROOT_STATE_DIR = "/var/lib/phasewise"


class StateDirError(ValueError):
    """A state directory that cannot be used: the message is one line saying why."""


def default_data_dir(euid: int | None = None, environ: Mapping[str, str] | None = None) -> str:
    """``/var/lib/phasewise`` for root; else ``$XDG_STATE_HOME/phasewise`` or ``~/.local/state/phasewise``.

    >>> default_data_dir(0, {})
    '/var/lib/phasewise'
    >>> default_data_dir(1000, {"XDG_STATE_HOME": "/home/u/.state", "HOME": "/home/u"})
    '/home/u/.state/phasewise'
    >>> default_data_dir(1000, {"XDG_STATE_HOME": "relative", "HOME": "/home/u"})
    '/home/u/.local/state/phasewise'
    """
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        return ROOT_STATE_DIR
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return os.path.join(xdg, "phasewise")
    home = env.get("HOME", "")
    if not os.path.isabs(home):
        try:
            home = pwd.getpwuid(euid).pw_dir
        except KeyError:  # a uid without a passwd entry (containers): no home to use
            home = ""
    if not os.path.isabs(home) or home == "/":
        # nowhere private to default to; ensure_state_dir checks whatever is used
        return f"/var/tmp/phasewise-{euid}"
    return os.path.join(home, ".local", "state", "phasewise")


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def ensure_state_dir(path: str | os.PathLike, *, mode: int = 0o700, uid: int | None = None) -> Path:
    """Make sure *path* is a state directory only *uid* (default: this process's user) controls.

    Creates it (and missing parents) when it is not there, with *mode*
    (not narrowed by the umask). Refuses (:class:`StateDirError`) a path that
    is a symbolic link or not a directory, a directory owned by another user
    or writable by group or others, and one below a directory (or a link)
    that belongs to a user other than root and *uid*, who could replace it.
    An existing directory keeps its mode. Returns the absolute path.
    """
    uid = os.geteuid() if uid is None else uid
    p = Path(os.path.abspath(os.fspath(path)))
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StateDirError(f"{p}: cannot create its parent directory: {e.strerror or e}") from None
    _check_ancestors(p, uid)
    created = False
    try:
        os.mkdir(p, mode)
        created = True
    except FileExistsError:
        pass
    except OSError as e:
        raise StateDirError(f"{p}: cannot create it: {e.strerror or e}") from None
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # which of the two a link gives varies with the flags
            if os.path.islink(p):
                raise StateDirError(f"{p} is a symbolic link; a state directory must be a real directory "
                                    "(another user may have put the link there)") from None
            raise StateDirError(f"{p} is not a directory") from None
        raise StateDirError(f"{p}: cannot open it: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise StateDirError(f"{p} is owned by {_user(st.st_uid)}, not by {_user(uid)} that runs this role; "
                                "remove it or give it to that user")
        if created:
            os.fchmod(fd, mode)  # the umask narrowed mkdir's mode
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StateDirError(f"{p} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                                "chmod go-w it")
    finally:
        os.close(fd)
    return p


def _check_ancestors(p: Path, uid: int) -> None:
    """Every directory above *p*, and every link on the way, belongs to root or *uid*."""
    for a in reversed(p.parents):
        try:
            lst = os.lstat(a)
            st = os.stat(a) if stat.S_ISLNK(lst.st_mode) else lst
        except OSError as e:
            raise StateDirError(f"{p}: cannot inspect {a}: {e.strerror or e}") from None
        for what, s in ((("link", lst),) if stat.S_ISLNK(lst.st_mode) else ()) + (("directory", st),):
            if s.st_uid not in (0, uid):
                raise StateDirError(f"{p} lies below {a}, a {what} owned by {_user(s.st_uid)}, who could replace "
                                    "the state directory; choose a data_dir below directories of root or "
                                    "this role's user")
