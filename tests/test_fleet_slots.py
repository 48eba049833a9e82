"""Device slots: what each device of a fleet is, from the config alone and without torch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from import_helpers import modules_loaded

from fedge.edge.data.partition import DeviceSplit
from fedge.errors import ConfigError
from fedge.fleet.config import device_ids, load_fleet, parse_fleet
from fedge.fleet.devices import build_devices, load_fleet_data
from fedge.fleet.slots import checked_slots, device_slot, device_slots, fleet_classes

FLEET = """
[run]
method = "fedproto"
rounds = 1
dataset = "digits"
seed = 3

[partition]
kind = "shards"
shards_per_device = 2

[[devices]]
profile = "rpi-zero-2w"
count = 2

[[devices]]
profile = "rpi5-8gb"
archs = ["cnn3-p64", "cnn5-p64"]
count = 2
upload_precision = "int8"
"""


def _cfg(tmp_path: Path, text: str = FLEET):
    p = tmp_path / "fleet.toml"
    p.write_text(text)
    return load_fleet(p)


def test_slots_are_what_the_built_devices_announce(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    slots = device_slots(cfg)
    data = load_fleet_data(cfg)
    devices = build_devices(cfg, data)
    assert [s.info() for s in slots] == [d.info for d in devices]
    assert [s.mismatches(d.info) for s, d in zip(slots, devices, strict=True)] == [[]] * 4
    # Each slot's classes are the labels its built device trains on: two shards of the label-sorted
    # training set (8 shards of ~170 of digits' ~1350 images), each spanning at most three classes of ~135.
    for s, d in zip(slots, devices, strict=True):
        assert s.classes == tuple(int(c) for c in np.unique(d.method.ctx.train.y))
        assert 1 <= len(s.classes) <= 6
        assert s.num_samples == len(d.method.ctx.train) > 0
        assert s.plan.to_dict() == d.plan
    assert [s.arch for s in slots[2:]] == ["cnn3-p64", "cnn5-p64"]
    # The group's override replaces the planner's choice, and says so.
    assert [s.upload_precision for s in slots] == [slots[0].plan.upload_precision] * 2 + ["int8"] * 2
    assert slots[2].plan.reasons["upload_precision"] == "set by the fleet config's [[devices]]"
    assert fleet_classes(cfg) == tuple(str(i) for i in range(10))


def test_mismatches_name_each_differing_field(tmp_path: Path) -> None:
    slot = device_slots(_cfg(tmp_path))[2]
    hello = dataclasses.replace(slot.info(), arch="cnn4-p64", num_samples=slot.num_samples + 1)
    assert slot.mismatches(hello) == [
        "arch: expected 'cnn3-p64', got 'cnn4-p64'",
        f"num_samples: expected {slot.num_samples}, got {slot.num_samples + 1}",
    ]


def test_bad_upload_precision_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="upload_precision 'fp8' is not a precision") as e:
        parse_fleet({"run": {"method": "local", "rounds": 1},
                     "devices": [{"profile": "rpi5-8gb", "upload_precision": "fp8"}]})
    assert "fp16" in (e.value.hint or "")


def test_slots_need_no_torch(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    code = (
        "from fedge.fleet.config import load_fleet\n"
        "from fedge.fleet.slots import device_slots\n"
        f"slots = device_slots(load_fleet({str(path)!r}))\n"
        "assert len(slots) == 4 and all(s.num_samples > 0 for s in slots)\n"
    )
    assert modules_loaded(code, "torch", "torchvision") == []


def test_a_large_own_data_fleets_slots_share_their_parts_and_match_one_by_one(tmp_path: Path) -> None:
    """checked_slots builds the ids, profiles, plans and specs once (SlotParts): the same slots as building
    each alone, and a 20,000-device fleet's in well under a second's worth of plans (it took about a minute)."""
    text = FLEET.replace('[partition]\nkind = "shards"\nshards_per_device = 2\n',
                         '[data]\nclasses = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]\n')
    text = text.replace("count = 2\n\n", "count = 19998\n\n", 1)
    cfg = _cfg(tmp_path, text)
    slots = checked_slots(cfg)
    assert len(slots) == 20000 and slots[-1].device_id == "rpi5-8gb-2"
    zero = np.zeros(1, dtype=np.int64)
    one = DeviceSplit(zero, np.zeros(0, dtype=np.int64))
    for i in (0, 19997, 19998, 19999):  # the groups' edges; each arch of the second group's archs in turn
        assert slots[i] == device_slot(cfg, i, zero, one)
    assert [s.arch for s in slots[-2:]] == ["cnn3-p64", "cnn5-p64"]
    assert slots[0].plan is slots[19997].plan  # one plan per (group, samples), shared


def test_duplicate_ids_are_found_in_a_large_fleet() -> None:
    cfg = parse_fleet({"run": {"method": "local", "rounds": 1},
                       "devices": [{"profile": "rpi5-8gb", "count": 20000, "id_prefix": "x"},
                                   {"profile": "rpi4-2gb", "count": 2, "id_prefix": "x"}]})
    with pytest.raises(ConfigError, match=r"duplicate device ids \['x-1', 'x-2'\]"):
        device_ids(cfg)
