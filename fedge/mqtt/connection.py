"""Where and how an MQTT client connects: :class:`BrokerSettings` (host, port, credentials, TLS, back-off)
and :func:`parse_broker_url`. Plain Python (no paho): every command that takes ``--broker`` reads it, and the
client (:mod:`fedge.mqtt.client`) connects with it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote, urlsplit

from fedge.errors import ConfigError

DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883


@dataclass(frozen=True)
class BrokerSettings:
    """Where and how to connect: host, port, credentials, TLS."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca_file: str | None = None
    # Mutual TLS: this client's certificate and key (PEM); the broker takes its CN as the user name.
    cert_file: str | None = None
    key_file: str | None = None
    keepalive_s: int = 15
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"broker port {self.port} is out of range")
        if self.ca_file and not self.tls:
            raise ConfigError("a CA file was given without TLS", hint="add --tls or use an mqtts:// URL")
        if self.reconnect_min_s <= 0 or self.reconnect_max_s < self.reconnect_min_s:
            raise ConfigError("reconnect back-off must satisfy 0 < min <= max")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("a client certificate needs its key and a key its certificate",
                              hint="give both --cert and --key (a bundle's device.crt and device.key)")
        if self.cert_file is not None:
            if not self.tls:
                raise ConfigError("a client certificate was given without TLS", hint="use an mqtts:// URL or --tls")
            from fedge.mqtt.certfiles import check_client_files

            check_client_files(self.cert_file, str(self.key_file))

    @property
    def url(self) -> str:
        """The broker URL without credentials (safe to log)."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def with_credentials(self, username: str | None, password: str | None) -> BrokerSettings:
        return replace(self, username=username, password=password)


def parse_broker_url(url: str, **overrides: Any) -> BrokerSettings:
    """``mqtt://[user[:password]@]host[:port]`` or ``mqtts://...`` → :class:`BrokerSettings`.

    Keyword ``overrides`` (``username``, ``password``, ``tls``, ``ca_file`` ...) win over the URL
    when they are not None.
    """
    parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
        raise ConfigError(f"broker URL {url!r} has scheme {parts.scheme!r}", hint="use mqtt://HOST:PORT or mqtts://")
    tls = parts.scheme in ("mqtts", "ssl")
    try:
        port = parts.port or (DEFAULT_TLS_PORT if tls else DEFAULT_PORT)
    except ValueError as exc:
        raise ConfigError(f"broker URL {url!r} has an invalid port") from exc
    fields: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1",
        "port": port,
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
        "tls": tls,
    }
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if fields.get("ca_file") or fields.get("cert_file"):
        fields["tls"] = True
    return BrokerSettings(**fields)
