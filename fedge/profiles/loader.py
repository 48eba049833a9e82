"""Find, read and write device profiles (built-in by name, or any TOML file by path)."""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedge.common.tomlconf import build, read_toml
from fedge.errors import ConfigError, ProfileError
from fedge.profiles.power import Power
from fedge.profiles.schema import Measured, Profile
from fedge.profiles.thermal import Thermal

log = logging.getLogger(__name__)


def builtin_dir() -> Path:
    """The directory of the built-in profiles (installed as package data)."""
    return Path(__file__).with_name("builtin")


def list_profiles() -> tuple[str, ...]:
    """Names of the built-in profiles, sorted."""
    return tuple(sorted(p.stem for p in builtin_dir().glob("*.toml")))


def _as_profile_error(exc: ConfigError) -> ProfileError:
    return exc if isinstance(exc, ProfileError) else ProfileError(exc.message, hint=exc.hint)


def parse_profile(data: dict[str, Any], *, source: str) -> Profile:
    """Build a :class:`Profile` from plain data (a parsed TOML file, or :meth:`Profile.to_dict`).

    ``source`` names where the data came from in error messages (a file path,
    or e.g. ``"hello from dev-3"``).
    """
    data = dict(data)
    # tomlconf builds nested dataclasses but not optional ones: build [measured], [power], [thermal] separately.
    optional: dict[str, Any] = {k: data.pop(k) for k in ("measured", "power", "thermal") if k in data}
    tables: dict[str, type] = {"measured": Measured, "power": Power, "thermal": Thermal}
    try:
        profile = build(Profile, data, source=source)
        built: dict[str, Any] = {k: build(tables[k], raw, source=source, section=k) for k, raw in optional.items()}
        if built:
            try:
                profile = replace(profile, **built)
            except ProfileError as exc:  # a check across tables ([thermal] needs [power]): name the file too
                raise ProfileError(f"{source}: {exc.message}", hint=exc.hint) from exc
    except ConfigError as exc:
        raise _as_profile_error(exc) from exc
    return profile


def _is_path(ref: str | Path) -> bool:
    s = str(ref)
    return isinstance(ref, Path) or "/" in s or "\\" in s or s.endswith(".toml")


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a built-in profile by name (``"rpi4-4gb"``) or any profile file by path.

    A reference with a path separator or a ``.toml`` suffix is a path; anything
    else names a built-in. Raises :class:`ProfileError` (exit code 2) naming the
    file, the key and the fix.
    """
    if _is_path(name_or_path):
        path = Path(name_or_path)
    else:
        name = str(name_or_path)
        path = builtin_dir() / f"{name}.toml"
        if not path.is_file():
            known = list_profiles()
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ProfileError(
                f"unknown profile {name!r}",
                hint=f"{hint}built-in profiles: {', '.join(known)}; or give the path to your own .toml profile",
            )
    try:
        data = read_toml(path)
    except ConfigError as exc:
        raise _as_profile_error(exc) from exc
    profile = parse_profile(data, source=str(path))
    log.debug("loaded profile %s from %s", profile.name, path)
    return profile


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dump_profile(profile: Profile, *, comment: str = "") -> str:
    """The profile as TOML text that :func:`load_profile` reads back to an equal profile.

    Used to write a measured profile; ``comment`` (e.g. where the figures come
    from) is written as leading ``#`` lines.
    """
    d = profile.to_dict()
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    lines += [f"{k} = {_toml_value(d[k])}" for k in ("name", "description")]
    for table in ("hardware", "network", "budgets", "measured", "power", "thermal"):
        if table in d:
            lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in d[table].items()]
    return "\n".join(lines) + "\n"
