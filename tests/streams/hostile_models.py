"""``module:function`` models that misbehave, for horus's child process (tests/streams/test_horus_models.py).

A job event names them as ``tests.streams.hostile_models:NAME``; horus builds them only when the test lists
this module in ``horus_model_modules``.
"""

from __future__ import annotations

import os
import signal
import time

from torch import nn


def good() -> nn.Module:
    """A model that behaves: an MLP on BipedalWalker's 24-wide state vectors."""
    return nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))


def spin() -> nn.Module:
    """Loops for ever (CPU)."""
    while True:
        pass


def nap() -> nn.Module:
    """Sleeps for ever (no CPU)."""
    time.sleep(10**6)
    return good()


def hog() -> nn.Module:
    """Asks for 50 GB at once."""
    return nn.Sequential(nn.Linear(24, 4), nn.Dropout(len(bytearray(50 * 10**9))))


def kill_parent() -> nn.Module:
    """Kills the process that forked it (the build server)."""
    os.kill(os.getppid(), signal.SIGKILL)
    return good()


def change_torch() -> nn.Module:
    """Changes torch for whoever builds next in this process."""
    nn.Linear.forward = lambda self, x: x  # type: ignore[method-assign]
    return good()
