"""The fleet layer: what every role reads about a fleet.

:mod:`~fedge.fleet.config` (the fleet config, device ids) and :mod:`~fedge.fleet.slots` (each
device's torch-free :class:`~fedge.fleet.slots.DeviceSlot`: profile, plan, model spec, upload
precision, data share) need no torch; :mod:`~fedge.fleet.devices` builds the device itself (data,
model, method half) from its slot and needs torch — nothing torch-free imports it.
"""
