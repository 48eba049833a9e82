"""Where each part of a device's model starts: the seeds of its initial weights (no torch).

Averaging weights is only meaningful when the averaged networks start from one
point: the first average of independently initialised networks mixes unrelated
hidden units and throws most of the first rounds away (McMahan et al., 2017,
fig. 1). So every part of a model that some method averages starts from a seed
shared by every device that averages it:

* the whole network of a device whose method averages within its architecture
  group (FedAvg, LG-FedAvg, GeFL's target networks, GeFL-F's warm-up) starts
  from the *group's* seed, the same on every device of that architecture;
* a part averaged over the whole fleet (the common extractor of LG-FedAvg,
  GeFL with ``avg_extractor``, GeFL-F) is then re-initialised from the *part's*
  seed, the same on every device;
* everything else keeps the device's own seed, ``run_seed * 1000 + index``:
  Local, FedProto and FedVTC average no weights, and independent starts are
  what a user comparing devices expects of them.

A seed is derived from the run's seed and the part's name only (SHA-256, below),
so a device built anywhere from the fleet config — a simulation, ``fedge edge
run``, a flashed board — starts where the others do without a message. The
coordinator stays torch-free and publishes nothing at round 0; a device that
joins later loads the current global state before its first local step, as
every device does each round (``needed_artifacts`` / ``apply_global``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

GROUP_PART = "group"  # the whole network of an architecture group


def part_seed(run_seed: int, part: str) -> int:
    """The seed of ``part`` in a run: the first 8 bytes of
    ``SHA-256("fedge-init/{run_seed}/{part}")``, big-endian, shifted right by one bit
    (so it is a non-negative 63-bit integer, which ``torch.manual_seed`` accepts).

    ``part`` is ``"group/{arch}"`` for an architecture group's network and the
    state-dict prefix without its dot (``"extractor"``) for a fleet-wide part."""
    digest = hashlib.sha256(f"fedge-init/{run_seed}/{part}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def device_seed(run_seed: int, index: int) -> int:
    """A device's own seed (its per-device parts, its data shuffling): ``run_seed * 1000 + index``."""
    return run_seed * 1000 + index


@dataclass(frozen=True)
class SharedStart:
    """Which parts of a method's models start from a shared seed.

    ``group``: the whole network starts from its architecture group's seed.
    ``fleet``: state-dict prefixes (``"extractor."``) re-initialised from the part's
    seed on every device, whatever its architecture."""

    group: bool = False
    fleet: tuple[str, ...] = ()

    @property
    def shared(self) -> bool:
        return self.group or bool(self.fleet)

    def describe(self) -> str:
        """One word for reports and benchmark cells: ``per-device``, ``group``, ``group+extractor``."""
        parts = (["group"] if self.group else []) + [p.rstrip(".") for p in self.fleet]
        return "+".join(parts) or "per-device"


PER_DEVICE = SharedStart()


@dataclass(frozen=True)
class InitSeeds:
    """The seeds a device builds its model from: ``model`` for the whole network, then each
    ``(prefix, seed)`` of ``parts`` re-initialises that part."""

    model: int
    parts: tuple[tuple[str, int], ...] = ()


def init_seeds(start: SharedStart, *, run_seed: int, index: int, arch: str) -> InitSeeds:
    """The seeds of device number ``index`` (fleet order) of architecture ``arch``."""
    model = part_seed(run_seed, f"{GROUP_PART}/{arch}") if start.group else device_seed(run_seed, index)
    return InitSeeds(model, tuple((p, part_seed(run_seed, p.rstrip("."))) for p in start.fleet))
