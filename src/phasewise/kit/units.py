"""Cores and bytes as people read them, in a table column or a message (reading sizes:
:func:`phasewise.kit.settings.parse_size`).
"""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_cores"]


def fmt_cores(x: float | None, *, words: bool = False) -> str:
    """CPU cores: ``'1.50'`` in a table column, ``'1.5 cores'`` in words; ``'-'`` for ``None``
    (unknown, or no limit).

    >>> fmt_cores(1.5), fmt_cores(0.25, words=True), fmt_cores(None)
    ('1.50', '0.25 cores', '-')
    """
    if x is None:
        return "-"
    return f"{x:g} cores" if words else f"{x:.2f}"


def fmt_bytes(x: float | None, *, words: bool = False) -> str:
    """Bytes in binary units: in a table column the largest unit that fits (``'3.0M'``); in words
    always MiB (``'3072.0 MiB'``), so the figures of one message compare at a glance; ``'-'`` for
    ``None``.

    >>> fmt_bytes(3 * 2**20), fmt_bytes(3 * 2**30), fmt_bytes(512), fmt_bytes(3 * 2**30, words=True)
    ('3.0M', '3.0G', '512B', '3072.0 MiB')
    """
    if x is None:
        return "-"
    if words:
        return f"{x / 2**20:.1f} MiB"
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(x) >= size:
            return f"{x / size:.1f}{unit}"
    return f"{x:.0f}B"
