"""Typed ``[method]`` settings: one frozen, self-validating dataclass per method (no torch).

A method's settings class (:mod:`fedge.common.method_settings`) declares every key of
its ``[method]`` table with :func:`setting`: the default, the bounds, the
allowed values and one line of documentation. :meth:`MethodSettings.parse`
turns the TOML table into an instance once; both halves of the method read
the same instance. Nothing is looked up by string afterwards, so a misspelt
key cannot silently fall back to its default::

    s = GeFLSettings.parse({"gen_rounds": 30, "gen_epoch": 10})
    # ConfigError: [method] unknown key 'gen_epoch' for method 'gefl'
    #   hint: did you mean 'gen_epochs'? valid keys: generator, generator_tier, ...

The same declarations render the key tables of ``docs/methods.md``
(:func:`settings_table`), and a test keeps the page equal to them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from fedge.common.initseeds import PER_DEVICE, SharedStart
from fedge.errors import ConfigError

_META = "fedge.setting"


@dataclass(frozen=True)
class SettingInfo:
    """How one ``[method]`` key is checked and documented."""

    doc: str
    minimum: float | None = None  # numbers: the smallest allowed value
    positive: bool = False  # numbers: strictly above 0 (e.g. a learning rate)
    choices: tuple[str, ...] = ()  # strings: the allowed values
    shown: str | None = None  # the default as the docs show it (e.g. "`[train] local_epochs`")
    key: str | None = None  # the TOML key when it is not a Python name (FedProto's ``lambda``)


def setting(default: Any, doc: str, *, minimum: float | None = None, positive: bool = False,
            choices: tuple[str, ...] = (), shown: str | None = None, key: str | None = None) -> Any:
    """Declare a ``[method]`` key as a dataclass field (see :class:`SettingInfo`)."""
    info = SettingInfo(doc, minimum, positive, choices, shown, key)
    return dataclasses.field(default=default, metadata={_META: info})


def _alternatives(choices: tuple[str, ...]) -> str:
    quoted = [repr(c) for c in choices]
    return " or ".join(quoted) if len(quoted) == 2 else "one of " + ", ".join(quoted)


@dataclass(frozen=True)
class MethodSettings:
    """The ``[method]`` table of one method, validated on construction.

    Subclasses set :attr:`method` (the ``[run] method`` name) and declare their
    keys with :func:`setting`. A field typed ``X | None`` defaulting to None
    means "decided elsewhere" (the plan, ``[train]``, the published default of
    the generator kind); the docs say where through ``shown``.
    """

    method: ClassVar[str] = ""
    # True when devices exchange feature-space statistics, so every device needs the same p.
    shares_features: ClassVar[bool] = False
    # True when the method trains a generator (federated, as GeFL's, or a local decoder, as FedVTC's): its
    # messages may carry one besides the model, so the broker's limits count the model twice (fedge.broker.limits).
    generative: ClassVar[bool] = False
    # Upload arrays that are statistics [privacy] clips and noises (fedge.common.privacy.STAT_ARRAYS).
    private_stats: ClassVar[tuple[str, ...]] = ()
    # Asynchronous mode ([coordinator] mode = "async", docs/async.md) is opt-in: ``async_rule`` says, in one line,
    # how the coordinator half folds an update that trained from an older version (its staleness weight, the
    # version it trained from). A method that declares none is refused in asynchronous mode: its stale updates
    # would count as fresh ones. ``async_refusal``: why it cannot run asynchronously at all (it wins).
    async_rule: ClassVar[str] = ""
    async_refusal: ClassVar[str | None] = None

    @classmethod
    def async_blocker(cls) -> str | None:
        """Why this method cannot run in asynchronous mode (None: it declares how it does)."""
        if cls.async_refusal is not None:
            return cls.async_refusal
        if not cls.async_rule:
            return (f"{cls.method or cls.__name__} declares no asynchronous rule (its settings' async_rule): how its "
                    "coordinator half weighs an update that trained from an older version is not said, so a stale "
                    "update would count as a fresh one")
        return None

    def statistics_passes(self, local_epochs: int) -> int:
        """Forward passes over its training samples a device makes per round besides training (the class
        statistics it uploads), for the virtual clock (:class:`fedge.fleet.clock.TrainWork`); 0 here."""
        return 0

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            info = f.metadata.get(_META)
            if info is None:
                continue
            value = getattr(self, f.name)
            checked = _check(info.key or f.name, value, hints[f.name], info)
            if checked is not value:  # an integer where a number is expected becomes a float
                object.__setattr__(self, f.name, checked)

    def shared_start(self) -> SharedStart:
        """Which parts of the devices' models start from a shared seed (:mod:`fedge.common.initseeds`):
        every part this method averages over more than one device. Default: none (each device its own)."""
        return PER_DEVICE

    @classmethod
    def fields_by_key(cls) -> dict[str, dataclasses.Field[Any]]:
        """TOML key -> field, in declaration order."""
        out = {}
        for f in dataclasses.fields(cls):
            info = f.metadata.get(_META)
            if info is not None:
                out[info.key or f.name] = f
        return out

    @classmethod
    def parse(cls, table: Mapping[str, Any] | None = None, *, source: str = "") -> Self:
        """Build the settings from a ``[method]`` table; unknown keys are a :class:`ConfigError`."""
        where = f"{source}: " if source else ""
        if table is not None and not isinstance(table, Mapping):
            raise ConfigError(f"{where}[method] must be a table, got {type(table).__name__}")
        table = dict(table or {})
        keys = cls.fields_by_key()
        unknown = [k for k in table if k not in keys]
        if unknown:
            key = unknown[0]
            if not keys:
                raise ConfigError(f"{where}[method] unknown key {key!r}: method {cls.method!r} takes no [method] keys",
                                  hint="remove the [method] table")
            close = difflib.get_close_matches(str(key), keys, n=1)
            guess = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}[method] unknown key {key!r} for method {cls.method!r}",
                              hint=f"{guess}valid keys: {', '.join(keys)}")
        try:
            return cls(**{keys[k].name: v for k, v in table.items()})
        except ConfigError as exc:
            if not source:
                raise
            raise ConfigError(f"{source}: {exc.message}", hint=exc.hint) from exc

    @classmethod
    def given(cls, settings: MethodSettings | None, user: str) -> Self:
        """``settings`` checked to be this method's (None: the defaults), for the half named ``user``."""
        if settings is None:
            return cls()
        if not isinstance(settings, cls):
            raise ConfigError(f"{user} needs {cls.__name__} (the [method] settings of {cls.method!r}), "
                              f"got {type(settings).__name__}",
                              hint="build both halves through fedge.fleet.registry.method_entry(name)")
        return settings

    def to_table(self) -> dict[str, Any]:
        """The settings as a ``[method]`` table (keys left at None omitted)."""
        return {k: getattr(self, f.name) for k, f in self.fields_by_key().items() if getattr(self, f.name) is not None}


class MethodName:
    """A method half's ``name``: its ``settings_type``'s :attr:`MethodSettings.method`.

    The device half's and the coordinator half's base classes each declare ``name = MethodName()``;
    a half sets only ``settings_type``, so the ``[run] method`` name is written once, in the
    settings class, and the three can never disagree.
    """

    def __get__(self, obj: object, owner: Any) -> str:
        settings: type[MethodSettings] = owner.settings_type
        return settings.method


def _check(key: str, value: Any, tp: Any, info: SettingInfo) -> Any:
    """``value`` if it fits ``tp`` and ``info``'s bounds (a float for an int given as a number), else raise."""
    args = typing.get_args(tp)
    optional = type(None) in args
    if optional and value is None:
        return value
    base = next(a for a in args if a is not type(None)) if args else tp
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"[method] {key} must be true or false, got {value!r}")
        return value
    if base is int:
        low = int(info.minimum) if info.minimum is not None else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"[method] {key} must be an integer >= {low}, got {value!r}")
        return value
    if base is float:
        floor = info.minimum if info.minimum is not None else 0.0
        # TOML has nan and inf; neither is a usable rate, weight or ratio (nan also passes every < test).
        if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                or value < floor or (info.positive and value <= 0)):
            bound = "> 0" if info.positive else f">= {floor:g}"
            raise ConfigError(f"[method] {key} must be a number {bound}, got {value!r}")
        return float(value) if isinstance(value, int) else value
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"[method] {key} must be a string, got {value!r}")
        if info.choices and value not in info.choices:
            raise ConfigError(f"[method] {key} must be {_alternatives(info.choices)}, got {value!r}")
        return value
    raise TypeError(f"setting {key!r}: unsupported type {tp!r}")  # a programming error, not user input


# -- documentation ---------------------------------------------------------------------------------

def _shown_default(f: dataclasses.Field[Any], info: SettingInfo) -> str:
    if info.shown is not None:
        return info.shown
    v = f.default
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'`"{v}"`'
    return f"{v:g}" if isinstance(v, float) else str(v)


def settings_table(cls: type[MethodSettings]) -> str:
    """The markdown table of ``cls``'s ``[method]`` keys: key, default, what it sets."""
    rows = ["| `[method]` key | default | what it sets |", "|---|---|---|"]
    for key, f in cls.fields_by_key().items():
        info: SettingInfo = f.metadata[_META]
        what = info.doc
        if info.choices:
            what += " (" + ", ".join(f'`"{c}"`' for c in info.choices) + ")"
        rows.append(f"| `{key}` | {_shown_default(f, info)} | {what} |")
    return "\n".join(rows)


def table_marker(cls: type[MethodSettings]) -> tuple[str, str]:
    """The comments that enclose ``cls``'s generated table in a markdown page."""
    start = f"<!-- [method] keys of {cls.method}: generated from fedge.common.method_settings -->"
    return start, "<!-- end of keys -->"


def sync_tables(text: str, classes: typing.Iterable[type[MethodSettings]]) -> str:
    """``text`` with every generated key table replaced by the current one (unchanged if up to date)."""
    for cls in classes:
        start, end = table_marker(cls)
        i = text.find(start)
        if i < 0:
            continue
        j = text.index(end, i)
        text = text[: i + len(start)] + "\n" + settings_table(cls) + "\n" + text[j:]
    return text
