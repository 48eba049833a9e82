"""Emulate a fleet in Docker: containers limited like their profiles, booting from flashed payloads.

:mod:`fedge.emulate.limits` turns profiles into CPU, memory and link limits (no Docker, no torch);
:mod:`fedge.emulate.calibrate` measures this host's training speed for the CPU quotas;
:mod:`fedge.emulate.compose` writes compose.yaml; :mod:`fedge.emulate.images` builds the images
from ``docker/``. Running a fleet, through the Docker SDK for Python and the compose CLI:
:mod:`fedge.emulate.discovery` finds the engine, the compose CLI and a project's containers;
:mod:`fedge.emulate.emulation` is one emulation's directory and state (``emulation.json``);
:mod:`fedge.emulate.lifecycle` writes, starts, waits for and takes down a fleet;
:mod:`fedge.emulate.status` reports each device's state and figures; :mod:`fedge.emulate.faults`
kills, pauses, partitions, throttles (:mod:`fedge.emulate.throttle`) and restarts its containers.
"""

FAULTS = ("kill", "pause", "partition", "throttle", "resume", "restart")
"""The words of ``fedge emulate fault`` (read by its command line without loading the Docker SDK)."""
