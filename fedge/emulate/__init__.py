"""Emulate a fleet in Docker: containers limited like their profiles, booting from flashed payloads.

:mod:`fedge.emulate.limits` turns profiles into CPU, memory and link limits (no Docker, no torch);
:mod:`fedge.emulate.calibrate` measures this host's training speed for the CPU quotas;
:mod:`fedge.emulate.compose` writes compose.yaml; :mod:`fedge.emulate.images` builds the images
from ``docker/``; :mod:`fedge.emulate.engine` runs, inspects and faults the fleet through the
Docker SDK for Python and the compose CLI.
"""
