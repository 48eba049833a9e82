"""Fleet configs: every bad config is a clear error naming file, key and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedge.cli import main
from fedge.errors import ConfigError
from fedge.fleet.config import device_ids, load_fleet, parse_fleet
from fedge.fleet.devices import build_devices, load_fleet_data
from fedge.sim.simulate import simulate

GOOD = """
[run]
method = "fedproto"
rounds = 2
dataset = "digits"

[partition]
kind = "dirichlet"
alpha = 0.5

[[devices]]
profile = "rpi-zero-2w"
count = 2

[[devices]]
profile = "rpi5-8gb"
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fleet.toml"
    p.write_text(text)
    return p


def test_good_config_loads(tmp_path: Path) -> None:
    cfg = load_fleet(_write(tmp_path, GOOD))
    assert cfg.num_devices == 3
    assert [i for i, _ in device_ids(cfg)] == ["rpi-zero-2w-1", "rpi-zero-2w-2", "rpi5-8gb-1"]
    assert cfg.partition.alpha == 0.5 and cfg.train.lr is None  # unset: the plan chooses (issue 45)
    assert cfg.train.val_fraction == 0.1 and cfg.train.min_tail is None


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (GOOD.replace("rounds = 2", "rounds = 2\nrouns = 3"), ["unknown key 'rouns'", "did you mean 'rounds'"]),
        (GOOD.replace('method = "fedproto"\n', ""), ["missing key 'method'"]),
        (GOOD.replace("rounds = 2", 'rounds = "two"'), ["'rounds' = 'two' is not int"]),
        (GOOD.replace("rounds = 2", "rounds = 0"), ["rounds must be >= 1"]),
        (GOOD.replace('kind = "dirichlet"', 'kind = "random"'), ["[partition]", "'kind' = 'random'"]),
        (GOOD.replace("alpha = 0.5", "alpha = -1"), ["alpha must be > 0"]),
        (GOOD.replace('dataset = "digits"', 'dataset = "imagenet"'), ["unknown dataset 'imagenet'"]),
        (GOOD.replace("count = 2", "count = 0"), ["[devices[0]]", "count must be >= 1"]),
        (GOOD.replace("count = 2", "count = 2\ncolor = 1"), ["[devices[0]]", "unknown key 'color'"]),
        ("[run]\nmethod='local'\nrounds=1\n", ["no [[devices]] tables"]),
        # [method] is parsed by the run's method when the config loads: a typo is not a silent default.
        (GOOD + "[method]\nlamda = 0.5\n", ["[method] unknown key 'lamda' for method 'fedproto'",
                                             "did you mean 'lambda'?", "valid keys: ", "lambda", "inference",
                                             "head_protos", "personalize"]),
        (GOOD + '[method]\nlambda = "big"\n', ["[method] lambda must be a number >= 0, got 'big'"]),
        (GOOD + '[method]\ninference = "nearest"\n', ["inference must be 'head' or 'prototype', got 'nearest'"]),
        (GOOD.replace('method = "fedproto"', 'method = "fedavg"') + "[method]\nlambda = 1\n",
         ["unknown key 'lambda'", "method 'fedavg' takes no [method] keys"]),
        ("[run\nmethod=", ["invalid TOML"]),
    ],
)
def test_bad_configs_name_the_problem(tmp_path: Path, text: str, needles: list[str]) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_fleet(path)
    msg = str(e.value)
    assert str(path) in msg
    for n in needles:
        assert n in msg


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_fleet(tmp_path / "nope.toml")


def test_unknown_profile_and_method_are_errors_before_training(tmp_path: Path) -> None:
    cfg = load_fleet(_write(tmp_path, GOOD.replace('profile = "rpi5-8gb"', 'profile = "rpi9"')))
    data = load_fleet_data(cfg)
    with pytest.raises(ConfigError, match="rpi9"):
        build_devices(cfg, data)
    # An unknown method is refused even earlier: its [method] table cannot be parsed without it.
    with pytest.raises(ConfigError, match="unknown method 'fedsgd'"):
        load_fleet(_write(tmp_path, GOOD.replace('method = "fedproto"', 'method = "fedsgd"')))


def test_prototype_methods_need_one_feature_size(tmp_path: Path) -> None:
    text = GOOD + '\n[[devices]]\nprofile = "rpi3b"\narch = "cnn2"\n'
    cfg = load_fleet(_write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"feature sizes differ \(\[64, 512\]\)") as e:
        build_devices(cfg, load_fleet_data(cfg))
    assert "cnn3-p64" in (e.value.hint or "")


def test_duplicate_device_ids(tmp_path: Path) -> None:
    cfg = parse_fleet({"run": {"method": "local", "rounds": 1},
                       "devices": [{"profile": "rpi3b", "id_prefix": "x"}, {"profile": "rpi3b", "id_prefix": "x"}]})
    with pytest.raises(ConfigError, match=r"duplicate device ids \['x-1'\]"):
        device_ids(cfg)


def test_cli_reports_config_errors_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, GOOD.replace("rounds = 2", "rounds = -1"))
    assert main(["simulate", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "fedge: error:" in err and "rounds must be >= 1" in err
    assert not (tmp_path / "out").exists()


def test_data_stats_prints_each_device_histogram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "stats", str(_write(tmp_path, GOOD))]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("rpi-zero-2w-", "rpi5-8gb-"))]
    assert len(rows) == 3
    # 10 class counts + train total + local-test total + validation fold per row; counts add up to the train total
    nums = [list(map(int, r.split()[1:])) for r in rows]
    assert all(sum(n[:10]) == n[10] for n in nums)
    assert all(n[12] == round((n[10] + n[12]) * 0.1) for n in nums)  # [train] val_fraction's default
    assert sum(n[10] + n[11] + n[12] for n in nums) == 1347  # the whole digits training split


def test_no_local_split_sends_no_local_accuracy() -> None:
    """local_test_fraction = 0 (the GeFL protocol examples): the devices have no local split, so their
    updates carry acc_global only; a NaN acc_local would be refused by the coordinator (JSON has no NaN)."""
    cfg = parse_fleet({"run": {"method": "fedavg", "rounds": 1, "dataset": "digits"},
                       "partition": {"local_test_fraction": 0.0},
                       "devices": [{"profile": "rpi5-8gb", "count": 2, "arch": "tier-xs"}]})
    res = simulate(cfg)
    for report in res.reports:
        assert report.rejected == {}
        assert sorted(report.accepted) == ["rpi5-8gb-1", "rpi5-8gb-2"]
    final = res.reports[-1].metrics
    assert all(set(m) >= {"acc_global"} and "acc_local" not in m for m in final.values())
    assert all(0.0 <= m["acc_global"] <= 1.0 for m in final.values())
