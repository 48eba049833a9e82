"""What ``fedge broker config`` writes, as options: apart from the writer so that building the CLI's parser
(which shows these defaults) does not import the certificate machinery (``cryptography``'s x509) into every
``fedge`` command, ``fedge infer`` on a board included."""

from __future__ import annotations

from dataclasses import dataclass

from fedge.broker.passwords import PBKDF2_ITERATIONS
from fedge.errors import ConfigError
from fedge.mqtt.chunking import DEFAULT_CHUNK_BYTES
from fedge.mqtt.topics import check_name

# Validity of client certificates, in days (the CA/Browser Forum's former maximum for TLS certificates).
CLIENT_DAYS = 825


@dataclass(frozen=True)
class BrokerOptions:
    """What ``fedge broker config`` writes."""

    port: int = 1883
    bind: str = "0.0.0.0"
    hostname: str = "localhost"  # the name devices use to reach the broker (URL in bundles, TLS name)
    tls: bool = False
    # Mutual TLS: a client certificate per account (CN = account name) instead of passwords; implies tls
    # and sign.
    mtls: bool = False
    # The fleet's Ed25519 signing key (coordinator/signing.key) and its public key in every bundle.
    sign: bool = False
    coordinator_user: str = "fedge-coordinator"
    deploy_user: str = "fedge-deploy"  # the account `fedge deploy` publishes model updates with
    client_days: int = CLIENT_DAYS  # validity of client certificates
    # The fleet's largest message (bytes); None: derived from the fleet config (limits.py).
    max_message_bytes: int | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # must match the coordinator's and devices' --chunk-bytes
    bundles: bool = True
    run_as: str | None = None  # mosquitto's `user` when started as root (None: its default, mosquitto)
    rotate: bool = False
    iterations: int = PBKDF2_ITERATIONS

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is out of range")
        if self.max_message_bytes is not None and self.max_message_bytes < 1024:
            raise ConfigError(f"--max-message-bytes {self.max_message_bytes} is too small")
        if self.chunk_bytes < 1024:
            raise ConfigError(f"--chunk-bytes {self.chunk_bytes} is too small (minimum 1024)")
        check_name(self.coordinator_user, "coordinator user name")
        check_name(self.deploy_user, "deploy user name")
        if self.deploy_user == self.coordinator_user:
            raise ConfigError("--deploy-user must differ from --coordinator-user: both connect at once, and a "
                              "client id is its user name")
        if self.client_days < 1:
            raise ConfigError(f"--cert-days {self.client_days} must be at least 1")

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.mtls

    @property
    def signs(self) -> bool:
        return self.sign or self.mtls
