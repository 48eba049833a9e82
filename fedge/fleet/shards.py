"""``[[shards]]`` in the fleet config: which broker shard each device talks to, and the tree of relays.

Example (a root broker, two sites, and a third shard relayed through site-a)::

    [[shards]]
    name = "site-a"                      # default: the shard's position, 1, 2, ...
    broker = "mqtt://10.0.1.5:1883"      # the address its devices and its relay reach its Mosquitto at
    devices = ["rpi4-4gb-*"]             # device ids or fnmatch patterns (``*``, ``?``, ``[...]``)

    [[shards]]
    name = "site-b"
    broker = "10.0.2.5:1883"             # HOST:PORT is mqtt://HOST:PORT (mqtts with --tls)
    devices = ["x86-gateway-1", "x86-gateway-2"]

    [[shards]]
    name = "annex"
    broker = "mqtt://10.0.1.6:1883"
    devices = ["rpi-zero-2w-*"]
    parent = "site-a"                    # its relay sends partials to site-a's broker (default: the root)

Every device of the fleet is in exactly one shard (a device in no shard is refused: the root broker of
a sharded fleet has no device accounts), a shard without devices of its own is the parent of another (a
regional level of relays), a parent names another shard, and the parent chains end at the root (no
cycle). Everything is checked when the fleet config loads (:func:`resolve_shards`), each
refusal naming the key and the fix. ``fedge broker config --shards N`` is the shorthand for N shards of
contiguous devices in fleet order on ports ``--port + 1 ... --port + N`` (:func:`even_shards`).
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from fedge.errors import ConfigError

log = logging.getLogger(__name__)

SCHEMES = {"mqtt": 1883, "mqtts": 8883}
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
MAX_NAME = 40


@dataclass(frozen=True)
class ShardSection:
    """One ``[[shards]]`` table as written (checked by :func:`resolve_shards`)."""

    broker: str = ""
    devices: tuple[str, ...] = ()
    name: str = ""
    parent: str = ""


@dataclass(frozen=True)
class Shard:
    """A checked shard: its broker's address, its own devices, its parent (None: the root)."""

    name: str
    host: str
    port: int
    devices: tuple[str, ...]  # this shard's own devices, in fleet order
    parent: str | None = None
    scheme: str | None = None  # as written (None: HOST:PORT; the broker's TLS setting decides)

    @property
    def relay(self) -> str:
        """The relay's account (on this shard's broker and on its parent's)."""
        return f"relay-{self.name}"

    @property
    def dirname(self) -> str:
        """Its directory under ``fedge broker config``'s ``shards/``."""
        return f"shard-{self.name}"


def even_shards(devices: list[str], count: int, host: str, port: int) -> list[Shard]:
    """``--shards N``: ``devices`` in N contiguous, near-equal shards (fleet order kept) named 1..N, on
    ``host`` ports ``port + 1 ... port + N``, each relayed to the root."""
    if count < 1:
        raise ConfigError(f"--shards {count} must be at least 1")
    if count > len(devices):
        raise ConfigError(f"--shards {count} is more than the fleet's {len(devices)} devices",
                          hint="use at most one shard per device")
    if port + count >= 65536:
        raise ConfigError(f"--port {port} + {count} shards runs past port 65535", hint="choose a lower --port")
    size, extra = divmod(len(devices), count)
    out, pos = [], 0
    for k in range(count):
        n = size + (1 if k < extra else 0)
        out.append(Shard(str(k + 1), host, port + k + 1, tuple(devices[pos:pos + n])))
        pos += n
    return out


def _where(source: str, k: int, name: str) -> str:
    return f"{source}: [[shards]] #{k + 1}" + (f" ({name!r})" if name else "")


def parse_address(address: str, where: str) -> tuple[str | None, str, int]:
    """``mqtt://HOST:PORT``, ``mqtts://HOST:PORT`` or ``HOST:PORT`` → (scheme or None, host, port)."""
    text = address.strip()
    parts = urlsplit(text if "://" in text else f"//{text}")
    scheme = parts.scheme or None
    hint = 'write broker = "mqtt://HOST:PORT" (or mqtts://), the address its devices and its relay reach it at'
    if scheme is not None and scheme not in SCHEMES:
        raise ConfigError(f"{where}: broker = {address!r} has scheme {scheme!r}", hint=hint)
    if parts.username or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{where}: broker = {address!r} must be only a scheme, a host and a port (credentials "
                          "come from `fedge broker config`)", hint=hint)
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{where}: broker = {address!r} has an invalid port", hint=hint) from exc
    if not parts.hostname:
        raise ConfigError(f"{where}: broker = {address!r} names no host", hint=hint)
    return scheme, parts.hostname, port or SCHEMES[scheme or "mqtt"]


def resolve_shards(sections: tuple[ShardSection, ...], devices: list[str], *, source: str) -> list[Shard]:
    """Check ``[[shards]]`` against the fleet's device ids (fleet order) and resolve it (module docstring).

    Refused, each naming the key and the fix: a shard without a broker, a bad or repeated name or broker
    address, a ``devices`` entry that matches no device, a device in two shards, a device in no shard, a
    ``parent`` that names no shard, and a cycle of parents."""
    if not sections:
        return []
    names = _shard_names(sections, source)
    owner: dict[str, int] = {}  # device -> shard index
    brokers: dict[tuple[str, int], int] = {}
    shards: list[Shard] = []
    order = {d: i for i, d in enumerate(devices)}
    for k, s in enumerate(sections):
        where = _where(source, k, s.name)
        if not s.broker.strip():
            raise ConfigError(f"{where} has no broker",
                              hint='add broker = "mqtt://HOST:PORT": the address of the Mosquitto its devices '
                                   "connect to (one broker per shard)")
        scheme, host, port = parse_address(s.broker, where)
        if (host, port) in brokers:
            raise ConfigError(f"{where}: broker = {s.broker!r} is also [[shards]] #{brokers[(host, port)] + 1}'s",
                              hint="each shard needs a broker of its own (another port or host); to put these "
                                   "devices together, list them in one shard")
        brokers[(host, port)] = k
        if not s.devices and not any(o.parent == names[k] for o in sections):
            raise ConfigError(f"{where} has no devices and no child shards",
                              hint='add devices = ["ID", "PREFIX-*", ...]: the device ids (or patterns) whose '
                                   "bundles name this shard's broker (a shard without devices must be the "
                                   "parent of another)")
        mine = sorted(_claim_devices(sections, k, devices, owner, where), key=order.__getitem__)
        shards.append(Shard(names[k], host, port, tuple(mine), s.parent or None, scheme))
    nowhere = [d for d in devices if d not in owner]
    if nowhere:
        raise ConfigError(f"{source}: [[shards]]: {len(nowhere)} device(s) of the fleet are in no shard "
                          f"({', '.join(nowhere[:5])}{', ...' if len(nowhere) > 5 else ''}); a sharded fleet's root "
                          "broker has no device accounts, so they could connect nowhere",
                          hint="add them to a shard's devices (an id or a pattern such as 'PREFIX-*'), or add a "
                               "[[shards]] table for them")
    _check_parents(shards, sections, source)
    log.debug("%s: %d shards, depth %d", source, len(shards), depth(shards))
    return shards


def _shard_names(sections: tuple[ShardSection, ...], source: str) -> list[str]:
    """Each shard's name (its position, 1-based, when it has none); a bad or repeated name is refused."""
    names: list[str] = []
    for k, s in enumerate(sections):
        name = s.name or str(k + 1)
        where = _where(source, k, s.name)
        if not set(name) <= NAME_CHARS or len(name) > MAX_NAME:
            raise ConfigError(f"{where}: name = {name!r} may hold only letters, digits, '-' and '_' (at most "
                              f"{MAX_NAME})", hint="it names the shard's directory and its relay's account")
        if name in names:
            raise ConfigError(f"{where}: name = {name!r} is used by [[shards]] #{names.index(name) + 1} too",
                              hint="give every shard its own name")
        names.append(name)
    return names


def _claim_devices(sections: tuple[ShardSection, ...], k: int, devices: list[str], owner: dict[str, int],
                   where: str) -> list[str]:
    """The devices shard ``k``'s ``devices`` entries match, noted in ``owner`` (device -> shard index); an entry
    that matches nothing and a device another shard holds are refused."""
    mine: list[str] = []
    known = set(devices)
    for pattern in sections[k].devices:
        hits = fnmatch.filter(devices, pattern) if any(c in pattern for c in "*?[") else (
            [pattern] if pattern in known else [])
        if not hits:
            close = difflib.get_close_matches(pattern, devices, n=1)
            raise ConfigError(f"{where}: devices entry {pattern!r} matches no device of the fleet",
                              hint=f"did you mean {close[0]!r}?" if close else
                              "use the ids `fedge broker config` prints (PREFIX-1, PREFIX-2, ...) or a pattern "
                              "such as 'PREFIX-*'")
        for d in hits:
            if d in owner and owner[d] != k:
                other = sections[owner[d]].name or str(owner[d] + 1)
                raise ConfigError(f"{where}: device {d!r} (from devices entry {pattern!r}) is already in "
                                  f"shard {other!r}: a device talks to one broker",
                                  hint=f"remove it from one of the two shards' devices (patterns: list the "
                                       f"ids, or narrow the pattern {pattern!r})")
            if d not in owner:
                owner[d] = k
                mine.append(d)
    return mine


def _check_parents(shards: list[Shard], sections: tuple[ShardSection, ...], source: str) -> None:
    """Refuse a ``parent`` that names no shard or the shard itself, and parents that form a cycle."""
    by_name = {s.name: s for s in shards}
    for k, sh in enumerate(shards):
        if sh.parent is None:
            continue
        if sh.parent not in by_name:
            close = difflib.get_close_matches(sh.parent, list(by_name), n=1)
            raise ConfigError(f"{_where(source, k, sections[k].name)}: parent = {sh.parent!r} names no shard",
                              hint=f"did you mean {close[0]!r}?" if close else
                              f"name one of {', '.join(repr(n) for n in by_name)}, or leave parent out (the root)")
        if sh.parent == sh.name:
            raise ConfigError(f"{_where(source, k, sections[k].name)}: parent = {sh.parent!r} is the shard itself",
                              hint="leave parent out (its relay reports to the root) or name another shard")
    for sh in shards:
        chain = [sh.name]
        cur = sh
        while cur.parent is not None:
            cur = by_name[cur.parent]
            if cur.name in chain:
                loop = " -> ".join([*chain[chain.index(cur.name):], cur.name])
                raise ConfigError(f"{source}: [[shards]] parents form a cycle of relays: {loop}; no relay of it "
                                  "reaches the root",
                                  hint=f"remove parent from one of these shards ({', '.join(chain)}) so that "
                                       "its relay reports to the root")
            chain.append(cur.name)


def subtree(shards: list[Shard], name: str) -> list[str]:
    """The devices a shard's relay reports: its own and its descendants' (fleet order within each shard)."""
    out = [d for s in shards if s.name == name for d in s.devices]
    for s in shards:
        if s.parent == name:
            out += subtree(shards, s.name)
    return out


def reporters(shards: list[Shard], parent: str | None = None) -> dict[str, frozenset[str]]:
    """Relay account -> the devices it may report, for the relays whose parent is ``parent`` (None: the
    root): a parent's ``EngineConfig.partial_reporters`` (set by fedge.coordinator.fromfleet), so a relay that
    lists another shard's device is refused (``partial-foreign``) and an account that is no relay of it too
    (``partial-unauthorized``)."""
    return {s.relay: frozenset(subtree(shards, s.name)) for s in shards if s.parent == parent}


def depth(shards: list[Shard]) -> int:
    """Levels of relays below the root (0: no shards; 1: every shard under the root)."""
    by_name = {s.name: s for s in shards}

    def level(s: Shard) -> int:
        return 1 if s.parent is None else 1 + level(by_name[s.parent])

    return max((level(s) for s in shards), default=0)
