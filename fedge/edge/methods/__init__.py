"""Device halves of every method (one module per family); :mod:`fedge.fleet.registry` names them."""

from __future__ import annotations

from fedge.edge.methods.base import DeviceContext, DeviceMethod

__all__ = ["DeviceContext", "DeviceMethod"]
