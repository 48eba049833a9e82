"""A device that trains on its own data folder (``fedge edge run --data DIR``).

The device is built from the fleet config exactly as on the benchmark path
(same profile, plan, architecture, seeds), but its training set and local test
split come from :class:`fedge.edge.data.local.LocalData` instead of a share of a
benchmark data set, and it has no global test set. :class:`OwnDataAgent`
rescans the folder before every round, so images a camera adds are used from
the next round on; a rescan that fails (a new unknown class folder, a file that
cannot be converted) is logged and the previous data kept: the agent never
stops over its data mid-run. What the scan found is written to a status file
(counts and the skipped paths); only counts travel to the coordinator
(the update's ``num_samples``), never paths or pixels.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedge.common.atomicfile import write_atomic
from fedge.common.rounds import RoundInfo
from fedge.edge.agent import DeviceAgent
from fedge.edge.data.local import LocalData, Scan
from fedge.edge.data.partition import DeviceSplit
from fedge.errors import ConfigError, FedgeError
from fedge.fleet.config import FleetConfig, device_ids
from fedge.fleet.devices import FleetData, SimDevice, build_device

log = logging.getLogger(__name__)


def local_data(cfg: FleetConfig, data_dir: str | os.PathLike[str]) -> LocalData:
    """The data folder of a device of ``cfg`` (classes, preprocessing and split seed from the config)."""
    if not cfg.own_data:
        raise ConfigError(f"{cfg.source} names no classes for the devices' own data (--data {data_dir})",
                          hint='add [data] classes = ["name1", "name2", ...] to the fleet config: the class '
                               "folder names, in label order, the same on every device")
    return LocalData(data_dir, cfg.data.classes, cfg.input_norm(), test_fraction=cfg.partition.local_test_fraction,
                     seed=cfg.run.seed)


def build_own_device(cfg: FleetConfig, device_id: str, data: LocalData) -> tuple[SimDevice, Scan]:
    """Device ``device_id`` of ``cfg`` with the training set and local test split of ``data``."""
    ids = [i for i, _ in device_ids(cfg)]
    idx = ids.index(device_id)
    scan = data.scan()
    # build_device indexes one FleetData: the device's own images are the "training set" and its
    # split points at them; the other devices' (unused) splits are empty.
    both = dataclasses.replace(scan.train, x=np.concatenate([scan.train.x, scan.test.x]),
                               y=np.concatenate([scan.train.y, scan.test.y]))
    n_train = len(scan.train)
    empty = np.zeros(0, dtype=np.int64)
    splits = [DeviceSplit(empty, empty)] * len(ids)
    splits[idx] = DeviceSplit(np.arange(n_train), np.arange(n_train, len(both)))
    dev = build_device(cfg, FleetData(both, scan.test, splits), idx)
    dev.method.ctx.global_test = None  # a device's own data has no shared test set
    dev.method.data_changed()
    return dev, scan


class OwnDataAgent(DeviceAgent):
    """A :class:`DeviceAgent` that rescans its data folder before every round."""

    def __init__(self, *args: Any, data: LocalData, scan: Scan, status_file: str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data = data
        self.scan = scan
        self.status_file = Path(status_file) if status_file else None
        self.data_error: str | None = None
        self._write_status(0)

    def refresh(self, round_: int) -> None:
        """Rescan the folder; on success the method trains on the new data, on failure on the old."""
        try:
            scan = self.data.scan()
        except FedgeError as exc:
            self.data_error = exc.message if exc.hint is None else f"{exc.message} (fix: {exc.hint})"
            log.warning("%s: round %d: keeping the previous data (%d images): %s", self.device.device_id, round_,
                        self.scan.num_images, self.data_error)
        except OSError as exc:  # the folder vanished (an unmounted card): train on what was read
            self.data_error = f"{self.data.root}: {exc}"
            log.warning("%s: round %d: keeping the previous data: %s", self.device.device_id, round_, exc)
        else:
            self.data_error = None
            if scan.new or len(scan.train) != len(self.scan.train) or len(scan.test) != len(self.scan.test):
                ctx = self.method.ctx
                ctx.train, ctx.local_test = scan.train, scan.test
                self.method.data_changed()
                self.device = dataclasses.replace(self.device, num_samples=len(scan.train))
                log.info("%s: round %d: %d training and %d test images (%d new, %d skipped)",
                         self.device.device_id, round_, len(scan.train), len(scan.test), scan.new,
                         len(scan.skipped))
            self.scan = scan
        self._write_status(round_)

    def handle_round(self, info: RoundInfo, descriptor_bytes: int = 0, *, secure: object = None) -> None:
        self.refresh(info.round)
        super().handle_round(info, descriptor_bytes, secure=secure)

    def status(self, round_: int) -> dict[str, Any]:
        """What the device knows about its data: counts, skipped files and why, the last scan error."""
        return {"device": self.device.device_id, "data": str(self.data.root), "round": round_,
                **self.scan.summary(), "skipped_files": dict(self.scan.skipped), "error": self.data_error,
                "time": time.time()}

    def _write_status(self, round_: int) -> None:
        if self.status_file is not None:
            write_status(self.status_file, self.status(round_))


def write_status(path: str | os.PathLike[str], status: dict[str, Any]) -> None:
    """Replace the status file ``path`` with ``status`` (JSON) in one step; a failure is only logged."""
    target = Path(path)
    try:
        # a convenience for whoever watches the device: replaced whole, never fsync-ed
        write_atomic(target, (json.dumps(status, indent=2) + "\n").encode(), durable=False)
    except OSError as exc:  # a status file is a convenience: never a reason to stop training
        log.warning("cannot write the status file %s: %s", target, exc)


def start_failed_status(device_id: str, data_dir: str | os.PathLike[str], exc: FedgeError) -> dict[str, Any]:
    """The status of a device whose data folder cannot start a run (e.g. still empty at first boot): the
    agent exits, systemd starts it again later, and the status file says why meanwhile."""
    error = exc.message if exc.hint is None else f"{exc.message} (fix: {exc.hint})"
    return {"device": device_id, "data": str(data_dir), "round": 0, "train": 0, "test": 0, "skipped": 0,
            "skipped_files": {}, "error": error, "time": time.time()}
