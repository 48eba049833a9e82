"""Device halves of every method, by name."""

from __future__ import annotations

from fedge.edge.methods.base import DeviceContext, DeviceMethod
from fedge.edge.methods.baselines import FedAvgDevice, FedProtoDevice, LGFedAvgDevice, LocalDevice
from fedge.edge.methods.fedvtc import FedVTCDevice
from fedge.edge.methods.gefl import GeFLDevice
from fedge.edge.methods.geflf import GeFLFDevice
from fedge.errors import ConfigError

DEVICE_METHODS: dict[str, type[DeviceMethod]] = {
    cls.name: cls
    for cls in (LocalDevice, FedAvgDevice, LGFedAvgDevice, FedProtoDevice, GeFLDevice, GeFLFDevice, FedVTCDevice)
}


def register_device_method(cls: type[DeviceMethod]) -> type[DeviceMethod]:
    """Class decorator: make a device half available by its ``name``."""
    DEVICE_METHODS[cls.name] = cls
    return cls


def device_method(name: str) -> type[DeviceMethod]:
    if name not in DEVICE_METHODS:
        raise ConfigError(f"unknown method {name!r}", hint=f"use one of {', '.join(sorted(DEVICE_METHODS))}")
    return DEVICE_METHODS[name]


__all__ = ["DEVICE_METHODS", "DeviceContext", "DeviceMethod", "device_method", "register_device_method"]
