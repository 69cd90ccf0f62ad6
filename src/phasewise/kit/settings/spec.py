"""The frame every setting is declared in: :func:`setting` (one field), :class:`Group` (a frozen group).

A field's declaration holds its default, how a text becomes its value
(``parse``), its check, choices, flag and help; :class:`Spec` is that
declaration as the environment, the flags and the reference read it. The
parsers and checks here raise ``ValueError(why)``, which a group turns into
a one-line :class:`SettingsError` naming the setting (docs/architecture.md,
"Settings").
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

ENV_PREFIX = "PHASEWISE_"


class SettingsError(ValueError):
    """A refused setting: ``str(e)`` is ``"<setting>: <why>"``, one line.

    ``SettingsError("why")`` (no setting) is a message on its own.
    """

    def __init__(self, setting: str, why: str | None = None) -> None:
        if why is None:
            setting, why = "", setting
        self.setting = setting
        self.why = why
        super().__init__(f"{setting}: {why}" if setting else why)


# --------------------------------------------------------------------------- parsers: text -> value
# Each raises ValueError(why) on a text it cannot read.


def parse_int(text: str) -> int:
    """An integer (``1_000`` too).

    >>> parse_int(" 42 ")
    42
    """
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def parse_float(text: str) -> float:
    """A finite number: ``nan`` and ``inf`` are refused (no setting means them)."""
    try:
        v = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise ValueError(f"{text!r} is not a finite number")
    return v


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false, yes/no, on/off, 1/0)")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """Bytes, with an optional decimal (``G``) or binary (``Gi``) unit, Kubernetes style.

    >>> parse_size("67108864"), parse_size("64Mi"), parse_size("1.5G"), parse_size("2KiB")
    (67108864, 67108864, 1500000000, 2048)
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 67108864, 64Mi, 1G)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_str(text: str) -> str:
    return text


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that divides them.

    >>> format_size(64 * 2**20), format_size(1000)
    ('64Mi', '1000')
    """
    for unit, k in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


# --------------------------------------------------------------------------- checks: value -> None
# Each raises ValueError(why) on a value the setting does not take.


def above(lo: float) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not v > lo:
            raise ValueError(f"must be > {lo}, got {v!r}")
    return check


def at_least(lo: float) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not v >= lo:
            raise ValueError(f"must be >= {lo}, got {v!r}")
    return check


def in_range(lo: float, hi: float, *, lo_open: bool = False,
             hi_open: bool = False) -> Callable[[Any], None]:
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def check(v: Any) -> None:
        if not ((lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)):
            raise ValueError(f"must be in {interval}, got {v!r}")
    return check


#: a TCP port, 0 = off
port = in_range(0, 65535)


def non_empty(v: str) -> None:
    if not v.strip():
        raise ValueError("must not be empty")


def one_of(choices: tuple[str, ...]) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if v not in choices:
            raise ValueError(f"invalid choice: {v!r} (choose from {', '.join(map(repr, choices))})")
    return check


# --------------------------------------------------------------------------- field declarations


#: field type -> (parser of its text, check that a value is of that type)
def _is_int(v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"must be an integer, got {v!r}")


def _is_number(v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"must be a finite number, got {v!r}")


def _is_bool(v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")


def _is_str(v: Any) -> None:
    if not isinstance(v, str):
        raise ValueError(f"must be a string, got {v!r}")


_KINDS: dict[str, tuple[Callable[[str], Any], Callable[[Any], None]]] = {
    "int": (parse_int, _is_int),
    "float": (parse_float, _is_number),
    "bool": (parse_bool, _is_bool),
    "str": (parse_str, _is_str),
}

_META = "phasewise"
_GROUP = "phasewise-group"


def is_group_field(f: dataclasses.Field) -> bool:
    """Whether *f* holds a group (:func:`group`) rather than a setting."""
    return _GROUP in f.metadata


def setting(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
            parse: Callable[[str], Any] | None = None, check: Callable[[Any], None] | None = None,
            choices: tuple[str, ...] | None = None, flag: str | None = None, help: str = "",
            name: str | None = None, secret: bool = False) -> Any:
    """A settings field with how it is read and checked.

    *parse*: text (environment, flag) -> value, raising ValueError(why); default
    by the field's type (``int``, ``float`` finite, ``bool``, ``str``).
    *check*: value -> None, raising ValueError(why). *choices*: the only values
    taken (argparse ``choices`` too). *flag*: the command-line flag, where a
    role has one. *help*: one line for ``--help``. *name*: the setting's name
    (``PHASEWISE_<NAME>``) where it is not the group's prefix + the field's name.
    *secret*: a password or key: never printed (:meth:`Settings.describe`
    shows ``'***'``, ``repr`` leaves it out), and a refused value is not quoted
    in the error.
    """
    meta = {_META: {"parse": parse, "check": check, "choices": choices, "flag": flag, "help": help,
                    "name": name, "secret": secret}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta, repr=not secret)
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


def group(cls: type) -> Any:
    """A :class:`Settings` field holding one group of settings (its defaults unless given)."""
    return dataclasses.field(default_factory=cls, metadata={_GROUP: True})


@dataclass(frozen=True, slots=True)
class Spec:
    """How one setting is read from text and checked (from its field's declaration)."""

    name: str
    kind: str
    parse: Callable[[str], Any]
    type_check: Callable[[Any], None]
    check: Callable[[Any], None] | None
    choices: tuple[str, ...] | None
    flag: str | None
    help: str
    #: the field: ``Settings.<group>.<field>``, or ``Settings.<field>`` where *group* is None
    field: str
    #: the default (``dataclasses.MISSING`` where *factory* computes it)
    default: Any
    factory: Callable[[], Any] | None = None
    group: str | None = None
    #: a password or key: shown as ``'***'`` wherever settings are printed
    secret: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default

    def validate(self, value: Any) -> None:
        """ValueError(why) unless *value* is one this setting takes."""
        self.type_check(value)
        if self.choices is not None:
            one_of(self.choices)(value)
        if self.check is not None:
            self.check(value)

    def read(self, text: str) -> Any:
        """Parse *text* and validate the value; ValueError(why) otherwise."""
        value = self.parse(text)
        self.validate(value)
        return value


def _spec(f: dataclasses.Field, prefix: str) -> Spec:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    default_parse, type_check = _KINDS.get(kind, (parse_str, lambda v: None))
    meta = f.metadata.get(_META, {})
    factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
    return Spec(name=meta.get("name") or prefix + f.name, kind=kind,
                parse=meta.get("parse") or default_parse, type_check=type_check,
                check=meta.get("check"), choices=meta.get("choices"), flag=meta.get("flag"),
                help=meta.get("help", ""), field=f.name, default=f.default, factory=factory,
                secret=meta.get("secret", False))


_OWN_SPECS: dict[type, tuple[Spec, ...]] = {}


def own_specs(cls: type) -> tuple[Spec, ...]:
    """The settings a group (or :class:`Settings`) declares itself, in field order."""
    specs = _OWN_SPECS.get(cls)
    if specs is None:
        prefix = getattr(cls, "PREFIX", "")
        specs = tuple(_spec(f, prefix) for f in fields(cls) if _GROUP not in f.metadata)
        _OWN_SPECS[cls] = specs
    return specs


class Group:
    """A frozen group of settings that validates itself when made.

    Each field against its declaration, then the rules between the group's
    fields (:meth:`_rules`); a refused value raises :class:`SettingsError`
    naming the setting (``vpa_time_scale``). ``PREFIX`` + a field's name is its
    setting's name unless the field declares ``name=``.
    """

    __slots__ = ()
    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for spec in own_specs(type(self)):
            try:
                spec.validate(getattr(self, spec.field))
            except ValueError as e:
                raise SettingsError(spec.name, "refused (a secret's value is not shown)" if spec.secret
                                    else str(e)) from None
        self._rules()

    def _rules(self) -> None:
        """SettingsError if the group's fields break a rule between them."""


def declared(name: str) -> Spec | None:
    """Setting *name*'s declaration, found in every group defined (``None``: no such setting).

    For the checks that must know other groups' settings (``job_env`` refuses secrets); everything
    else reads :data:`phasewise.kit.settings.SPECS`.
    """
    for cls in Group.__subclasses__():
        for spec in own_specs(cls):
            if spec.name == name:
                return spec
    return None
