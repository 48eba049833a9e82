"""Typed config: TOML tables → frozen dataclasses, with errors that name file, key and fix.

Config is data, never executed code. :func:`build` checks unknown keys,
missing fields and field types against the dataclass; value checks live in
each dataclass's ``__post_init__`` and raise :class:`ConfigError` themselves.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

from fedge.errors import ConfigError

T = TypeVar("T")


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file; a missing file or a syntax error is a :class:`ConfigError`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such file", hint="check the path (relative paths start at the current directory)")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from exc


def _type_ok(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in get_args(tp))
    if origin is typing.Literal:
        return value in get_args(tp)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        args = get_args(tp)
        return isinstance(value, list | tuple) and all(_type_ok(v, args[0]) for v in value) if args else True
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _describe(tp: Any) -> str:
    if get_origin(tp) is typing.Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def build(cls: type[T], data: Any, *, source: str, section: str = "") -> T:
    """Build dataclass ``cls`` from a TOML table, strictly.

    Nested dataclass fields are built recursively; lists become tuples when the
    field is typed as a tuple.
    """
    where = f"{source}: [{section}]" if section else f"{source}:"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    # a field computed from the others (init=False) is not a key: naming it in the table is refused too
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, fields, n=1)
        raise ConfigError(
            f"{where} unknown key {key!r}",
            hint=f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(fields)}",
        )
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        tp = hints[name]
        key = f"{section}.{name}" if section else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where} missing key {name!r} ({_describe(tp)})",
                                  hint=f"add `{name} = ...` to the [{section or 'top'}] table")
            continue
        value = data[name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            kwargs[name] = build(tp, value, source=source, section=key)
            continue
        if not _type_ok(value, tp):
            # a class may say what each key means (KEY_HINTS): the fix names an example
            hint = getattr(cls, "KEY_HINTS", {}).get(name, "")
            raise ConfigError(f"{where} key {name!r} = {value!r} is not {_describe(tp)}", hint=hint)
        if get_origin(tp) is tuple or (isinstance(value, list) and tuple in
                                       (get_origin(a) for a in get_args(tp))):
            value = tuple(value)
        if tp is float and isinstance(value, int):
            value = float(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where} {exc.message}", hint=exc.hint) from exc
