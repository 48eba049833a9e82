"""The MQTT topic tree of one fleet, in one place.

Every topic lives under ``fedge/{fleet}/``::

    fedge/{fleet}/devices/{id}/status        retained  "online" | "offline" (last-will: "offline")
    fedge/{fleet}/devices/{id}/hello         retained  hello message (profile, plan, architecture)
    fedge/{fleet}/devices/{id}/update        -         update message, or its chunk frames
    fedge/{fleet}/devices/{id}/health        -         health message (heartbeat, QoS 0)
    fedge/{fleet}/devices/{id}/secagg        -         a secure-aggregation stage message (or its chunk frames)
    fedge/{fleet}/secagg/{id}                -         the coordinator's stage messages for device {id}
    fedge/{fleet}/rounds/current             retained  round descriptor message
    fedge/{fleet}/rounds/resend              retained  a relay's request to send the cached update again (JSON)
    fedge/{fleet}/global/{artifact}          retained  global state message, or a chunk manifest
    fedge/{fleet}/global/{artifact}/part/{i} retained  chunk frame i of a chunked global state
    fedge/{fleet}/refused/{id}               retained  why the coordinator refused device {id} (empty: accepted)
    fedge/{fleet}/keys/fleet                 retained  the fleet's key chain: every rotation of its signing key
    fedge/{fleet}/ota/models/{version}       retained  a signed model package (or its chunk manifest)
    fedge/{fleet}/ota/models/{version}/part/{i} retained chunk frame i of a chunked model package
    fedge/{fleet}/ota/devices/{id}           retained  the signed deployment order for device {id}
    fedge/{fleet}/devices/{id}/ota           retained  the device's model version and update state (JSON)
    fedge/{fleet}/partials/{account}         -         a partial aggregate from an aggregation worker or relay
    fedge/{fleet}/relays/{account}/status    retained  a relay's "online" | "offline" (last-will) on its parent
    fedge/{fleet}/relays/{account}/secagg    -         a relay's sum of its devices' masked inputs (secure rounds)

A device writes only its own ``devices/{its id}/{status,hello,update,health,secagg}`` and reads
``rounds/#``, ``global/#`` and its own ``refused/{its id}`` and ``secagg/{its id}``; the coordinator reads
``devices/#`` and writes the rest. The broker
ACL written by ``fedge broker config`` enforces exactly this split, which is why
the coordinator trusts the ``{id}`` segment of the topic an update arrived on
more than the sender named inside it (see ``docs/protocol.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from fedge.errors import ConfigError

ROOT = "fedge"
# Ids, fleet and artifact names become topic levels: no '/', '+', '#', no spaces, no '$'.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")

DeviceTopicKind = Literal["status", "hello", "update", "health", "secagg"]
DEVICE_KINDS: tuple[str, ...] = ("status", "hello", "update", "health", "secagg")
STATUS_ONLINE = b"online"
STATUS_OFFLINE = b"offline"


def shared(group: str, topic_filter: str) -> str:
    """An MQTT 5 shared subscription: the broker hands each matching message to one member of ``group``."""
    return f"$share/{check_name(group, 'shared subscription group')}/{topic_filter}"


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is a valid topic level name, else raise :class:`ConfigError`."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(
            f"{what} {value!r} cannot be used in an MQTT topic",
            hint="use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return value


@dataclass(frozen=True)
class DeviceTopic:
    """A parsed device topic: which device, which kind."""

    device_id: str
    kind: DeviceTopicKind


@dataclass(frozen=True)
class GlobalTopic:
    """A parsed global-state topic: the artifact and, for a chunk, its part index."""

    artifact: str
    part: int | None = None


@dataclass(frozen=True)
class FleetTopics:
    """Topic names of one fleet; validates the fleet name on construction."""

    fleet: str

    def __post_init__(self) -> None:
        check_name(self.fleet, "fleet name")

    @property
    def base(self) -> str:
        return f"{ROOT}/{self.fleet}"

    # -- device side ----------------------------------------------------------------------
    def device(self, device_id: str, kind: DeviceTopicKind) -> str:
        """``fedge/{fleet}/devices/{id}/{kind}``."""
        check_name(device_id, "device id")
        if kind not in DEVICE_KINDS:
            raise ValueError(f"unknown device topic kind {kind!r}")
        return f"{self.base}/devices/{device_id}/{kind}"

    def status(self, device_id: str) -> str:
        return self.device(device_id, "status")

    def hello(self, device_id: str) -> str:
        return self.device(device_id, "hello")

    def update(self, device_id: str) -> str:
        return self.device(device_id, "update")

    def health(self, device_id: str) -> str:
        return self.device(device_id, "health")

    def secagg(self, device_id: str) -> str:
        """``fedge/{fleet}/devices/{id}/secagg``: the device's secure-aggregation stage messages."""
        return self.device(device_id, "secagg")

    def device_filter(self, kind: DeviceTopicKind) -> str:
        """Subscription filter for one kind of message from every device."""
        return f"{self.base}/devices/+/{kind}"

    # -- coordinator side -----------------------------------------------------------------
    @property
    def round(self) -> str:
        """The retained round descriptor."""
        return f"{self.base}/rounds/current"

    @property
    def resend(self) -> str:
        """A relay's retained request that devices send their cached update again (docs/protocol.md section 13):
        the relay forwards the coordinator's (signed) descriptor unchanged, so it cannot re-issue it."""
        return f"{self.base}/rounds/resend"

    def global_(self, artifact: str) -> str:
        """The retained global state ``artifact`` (whole message or chunk manifest)."""
        return f"{self.base}/global/{check_name(artifact, 'artifact name')}"

    def global_part(self, artifact: str, index: int) -> str:
        """Retained chunk ``index`` of a chunked global state."""
        return f"{self.global_(artifact)}/part/{int(index)}"

    def refused(self, device_id: str) -> str:
        """``fedge/{fleet}/refused/{id}``: the retained reason the coordinator refused a device."""
        return f"{self.base}/refused/{check_name(device_id, 'device id')}"

    def secagg_to(self, device_id: str) -> str:
        """``fedge/{fleet}/secagg/{id}``: the coordinator's secure-aggregation stage messages for one device
        (never retained: a stage message is for one round's stage only)."""
        return f"{self.base}/secagg/{check_name(device_id, 'device id')}"

    @property
    def refused_filter(self) -> str:
        return f"{self.base}/refused/+"

    def parse_refused(self, topic: str) -> str | None:
        """The device id of a ``refused/{id}`` topic of this fleet, else None."""
        return self._leaf(topic, "refused")

    def _leaf(self, topic: str, kind: str) -> str | None:
        """NAME of ``fedge/{fleet}/{kind}/NAME`` (a valid name), else None."""
        parts = topic.split("/")
        if len(parts) != 4 or parts[0] != ROOT or parts[1] != self.fleet or parts[2] != kind:
            return None
        return parts[3] if _NAME.match(parts[3]) else None

    def global_filter(self, artifact: str) -> str:
        """One subscription that covers the artifact and all its parts (``#`` matches the parent too)."""
        return f"{self.global_(artifact)}/#"

    @property
    def fleet_keys(self) -> str:
        """``fedge/{fleet}/keys/fleet``: the retained chain of the fleet key's rotations (JSON; written by the
        coordinator and ``fedge deploy``, read by every device: :mod:`fedge.common.keyrotation`)."""
        return f"{self.base}/keys/fleet"

    # -- over-the-air model updates (fedge deploy) ----------------------------------------
    def ota_model(self, version: int) -> str:
        """The retained model package of ``version`` (whole, or its chunk manifest)."""
        return f"{self.base}/ota/models/{int(version)}"

    def ota_model_part(self, version: int, index: int) -> str:
        """Retained chunk ``index`` of the model package of ``version``."""
        return f"{self.ota_model(version)}/part/{int(index)}"

    def ota_order(self, device_id: str) -> str:
        """``fedge/{fleet}/ota/devices/{id}``: the retained, signed deployment order for one device."""
        return f"{self.base}/ota/devices/{check_name(device_id, 'device id')}"

    def ota_status(self, device_id: str) -> str:
        """``fedge/{fleet}/devices/{id}/ota``: the device's retained update status (JSON)."""
        return f"{self.base}/devices/{check_name(device_id, 'device id')}/ota"

    def ota_status_filter(self) -> str:
        return f"{self.base}/devices/+/ota"

    # -- aggregators (workers, relays) -----------------------------------------------------
    def partial(self, account: str) -> str:
        """``fedge/{fleet}/partials/{account}``: where an aggregation worker or relay sends its partials."""
        return f"{self.base}/partials/{check_name(account, 'aggregator account')}"

    @property
    def partial_filter(self) -> str:
        return f"{self.base}/partials/+"

    def relay_status(self, account: str) -> str:
        """``fedge/{fleet}/relays/{account}/status``: a relay's status on its parent broker (last-will)."""
        return f"{self.base}/relays/{check_name(account, 'relay account')}/status"

    def relay_secagg(self, account: str) -> str:
        """``fedge/{fleet}/relays/{account}/secagg``: a relay's sums of its devices' masked inputs, on its parent
        broker (:mod:`fedge.secagg.partial`; chunked when large, never retained)."""
        return f"{self.base}/relays/{check_name(account, 'relay account')}/secagg"

    @property
    def relay_secagg_filter(self) -> str:
        return f"{self.base}/relays/+/secagg"

    def parse_relay_secagg(self, topic: str) -> str | None:
        """The relay account of a ``relays/{account}/secagg`` topic of this fleet, else None."""
        parts = topic.split("/")
        if len(parts) != 5 or parts[:3] != [ROOT, self.fleet, "relays"] or parts[4] != "secagg":
            return None
        return parts[3] if _NAME.match(parts[3]) else None

    def parse_partial(self, topic: str) -> str | None:
        """The account of a partial's topic of this fleet, else None."""
        return self._leaf(topic, "partials")

    # -- parsing --------------------------------------------------------------------------
    def parse_device(self, topic: str) -> DeviceTopic | None:
        """``DeviceTopic`` for a device topic of this fleet, else None."""
        parts = topic.split("/")
        if len(parts) != 5 or parts[0] != ROOT or parts[1] != self.fleet or parts[2] != "devices":
            return None
        if parts[4] not in DEVICE_KINDS or not _NAME.match(parts[3]):
            return None
        return DeviceTopic(parts[3], parts[4])  # type: ignore[arg-type]

    def parse_ota_status(self, topic: str) -> str | None:
        """The device id of an OTA status topic (``devices/{id}/ota``) of this fleet, else None."""
        parts = topic.split("/")
        if len(parts) != 5 or parts[0] != ROOT or parts[1] != self.fleet or parts[2] != "devices" or parts[4] != "ota":
            return None
        return parts[3] if _NAME.match(parts[3]) else None

    def parse_global(self, topic: str) -> GlobalTopic | None:
        """``GlobalTopic`` for a global-state topic of this fleet, else None."""
        parts = topic.split("/")
        if len(parts) < 4 or parts[0] != ROOT or parts[1] != self.fleet or parts[2] != "global":
            return None
        if not _NAME.match(parts[3]):
            return None
        if len(parts) == 4:
            return GlobalTopic(parts[3])
        if len(parts) == 6 and parts[4] == "part" and parts[5].isdigit():
            return GlobalTopic(parts[3], int(parts[5]))
        return None
