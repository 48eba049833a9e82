"""The broker flags every MQTT command shares (``fedge coordinator run``, ``fedge edge run``).

They configure a :class:`~fedge.mqtt.connection.BrokerSettings`, so they live beside it:
no role's command line imports another's.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from fedge.errors import ConfigError
from fedge.mqtt.connection import BrokerSettings, parse_broker_url


def add_broker_arguments(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--broker/--username/--password/--password-file/--tls/--ca/--cert/--key`` (every MQTT command)."""
    g = p.add_argument_group("broker")
    g.add_argument("--broker", metavar="URL", required=required,
                   help="mqtt://HOST:PORT or mqtts://HOST:PORT" + ("" if required else
                                                                     " (default: an embedded broker on loopback)"))
    g.add_argument("--username", help="MQTT user name")
    g.add_argument("--password", help="MQTT password (visible in the process list: prefer --password-file or "
                                      "the FEDGE_MQTT_PASSWORD environment variable)")
    g.add_argument("--password-file", metavar="FILE", help="read the MQTT password from FILE")
    g.add_argument("--tls", action="store_true", help="connect with TLS")
    g.add_argument("--ca", metavar="FILE", help="CA certificate that signed the broker's certificate (implies --tls)")
    g.add_argument("--cert", metavar="FILE", help="client certificate for mutual TLS (implies --tls; with --key)")
    g.add_argument("--key", metavar="FILE", help="the client certificate's private key (mode 0600)")


def broker_settings(args: argparse.Namespace, url: str | None = None) -> BrokerSettings:
    """BrokerSettings from the shared broker flags (password: flag, file, then environment)."""
    password = args.password
    if password is None and getattr(args, "password_file", None):
        path = Path(args.password_file)
        if not path.is_file():
            raise ConfigError(f"password file {path} does not exist")
        password = path.read_text().strip()
    if password is None:
        password = os.environ.get("FEDGE_MQTT_PASSWORD")
    cert = getattr(args, "cert", None)
    return parse_broker_url(url or args.broker, username=args.username, password=password,
                            tls=True if (args.tls or args.ca or cert) else None, ca_file=args.ca,
                            cert_file=cert, key_file=getattr(args, "key", None))
