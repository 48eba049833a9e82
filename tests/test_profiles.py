"""Device profiles: validation errors, the built-in files, dump/load, and ``fedge profile`` on the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fedge.cli import main
from fedge.errors import ConfigError, ProfileError
from fedge.profiles import (
    Measured,
    Profile,
    builtin_dir,
    dump_profile,
    list_profiles,
    load_profile,
    parse_profile,
    plan,
)

BUILTINS = ("rpi-zero-2w", "rpi3b", "rpi4-2gb", "rpi4-4gb", "rpi5-8gb", "jetson-nano", "x86-gateway")
BASE = (builtin_dir() / "rpi4-4gb.toml").read_text()


def write(tmp_path: Path, text: str, name: str = "custom.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def edit(old: str, new: str) -> str:
    """The rpi4-4gb profile with one line changed (the old line must exist)."""
    assert old in BASE, old
    return BASE.replace(old, new)


def load_error(tmp_path: Path, text: str) -> ProfileError:
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(path) in info.value.message, "the message names the file"
    return info.value


# -- validation: every error names the file, the key and the fix ------------------------------


def test_unknown_key_names_table_and_suggests_the_right_key(tmp_path: Path) -> None:
    err = load_error(tmp_path, edit("cores = 4", "cores = 4\ncoers = 4"))
    assert "[hardware]" in err.message and "unknown key 'coers'" in err.message
    assert err.hint == "did you mean 'cores'?"


def test_missing_key_says_what_to_add(tmp_path: Path) -> None:
    err = load_error(tmp_path, edit("ram_mb = 4096\n", ""))
    assert "[hardware]" in err.message and "missing key 'ram_mb'" in err.message
    assert err.hint is not None and "ram_mb = ..." in err.hint and "[hardware]" in err.hint


def test_missing_table(tmp_path: Path) -> None:
    text = BASE[: BASE.index("[network]")] + BASE[BASE.index("[budgets]"):]
    err = load_error(tmp_path, text)
    assert "missing key 'network'" in err.message


def test_wrong_type(tmp_path: Path) -> None:
    err = load_error(tmp_path, edit("cores = 4", 'cores = "4"'))
    assert "[hardware]" in err.message and "'cores'" in err.message and "is not int" in err.message


@pytest.mark.parametrize(
    ("old", "new", "key", "fix"),
    [
        ("cores = 4", "cores = 0", "cores = 0", "nproc"),
        ("clock_ghz = 1.8", "clock_ghz = 1800", "clock_ghz = 1800", "not MHz"),
        ("ram_mb = 4096", "ram_mb = 16", "ram_mb = 16", "4096 for 4 GB"),
        ('arch = "aarch64"', 'arch = "arm64"', "arch = 'arm64'", "did you mean 'aarch64'?"),
        ('arch = "aarch64"', 'arch = "mips"', "arch = 'mips'", "aarch64, armv7l, x86_64, riscv64"),
        ('arch = "aarch64"\n', 'arch = "armv7l"\n', "int8_dot = True", "set int8_dot = false"),
        ("accelerators = []", 'accelerators = ["cuda-fp61"]', "accelerators = 'cuda-fp61'",
         "did you mean 'cuda-fp16'?"),
        ("accelerators = []", 'accelerators = ["cuda-fp16", "cuda-fp16"]', "accelerators", "each accelerator once"),
        ("uplink_kbps = 100000", "uplink_kbps = -5", "uplink_kbps = -5", "kbit/s"),
        ("downlink_kbps = 100000", "downlink_kbps = 0", "downlink_kbps = 0", "kbit/s"),
        ("latency_ms = 5", "latency_ms = -1", "latency_ms = -1", "round-trip"),
        ("round_time_s = 60", "round_time_s = 0", "round_time_s = 0", "round of local training"),
        ('name = "rpi4-4gb"', 'name = "My Pi"', "name = 'My Pi'", "lower-case"),
    ],
)
def test_impossible_values(tmp_path: Path, old: str, new: str, key: str, fix: str) -> None:
    text = edit(old, new)
    if "int8_dot = True" in key:  # armv7l cannot have dotprod: switch it on
        text = text.replace("int8_dot = false", "int8_dot = true")
    err = load_error(tmp_path, text)
    assert key in err.message
    assert err.hint is not None and fix in err.hint


def test_training_budget_larger_than_ram(tmp_path: Path) -> None:
    err = load_error(tmp_path, edit("ram_mb = 4096", "ram_mb = 1024").replace(
        "train_memory_mb = 1024", "train_memory_mb = 2000"))
    assert "budgets.train_memory_mb = 2000" in err.message and "exceeds the device's RAM" in err.message
    assert err.hint is not None and "at most 768" in err.hint


def test_training_budget_must_leave_room_for_the_runtime(tmp_path: Path) -> None:
    err = load_error(tmp_path, edit("train_memory_mb = 1024", "train_memory_mb = 4000"))
    assert "budgets.train_memory_mb = 4000" in err.message and "OS, Python and torch" in err.message
    assert err.hint == "lower budgets.train_memory_mb to at most 3840"


def test_bad_toml(tmp_path: Path) -> None:
    err = load_error(tmp_path, BASE + "\n[budgets\n")
    assert "invalid TOML" in err.message


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ProfileError) as info:
        load_profile(missing)
    assert str(missing) in info.value.message and "no such file" in info.value.message
    assert info.value.hint is not None and "path" in info.value.hint


def test_unknown_name_lists_the_known_profiles() -> None:
    with pytest.raises(ProfileError) as info:
        load_profile("rpi4-4g")
    assert "unknown profile 'rpi4-4g'" in info.value.message
    assert info.value.hint is not None
    assert info.value.hint.startswith("did you mean 'rpi4-4gb'?")
    assert all(name in info.value.hint for name in BUILTINS)
    assert isinstance(info.value, ConfigError) and info.value.exit_code == 2


@pytest.mark.parametrize(
    ("measured", "key", "fix"),
    [
        ('latency_ms = { "tier-q/fp32" = 1.0 }', "latency_ms = 'tier-q/fp32'", "tier-m/int8-static"),
        ('latency_ms = { "tier-m/int4" = 1.0 }', "latency_ms = 'tier-m/int4'", "int8-dynamic"),
        ('latency_ms = { "tier-m/fp32" = -1.0 }', "latency_ms.tier-m/fp32 = -1:", "latency in ms"),
        ('latency_ms = { "tier-m/fp32" = "fast" }', "latency_ms.tier-m/fp32 = 'fast'", "latency in ms"),
        ('latency_ms = 3', "latency_ms = 3", "as a table"),
        ('latency_ms = { "tier-m/fp32" = 1.0 }\naccuracy_drop = { "int4" = 0.1 }', "accuracy_drop = 'int4'",
         "fp32, fp16"),
        ('latency_ms = { "tier-m/fp32" = 1.0 }\naccuracy_drop = { "fp16" = 300 }', "accuracy_drop.fp16 = 300",
         "points"),
        ('latency = { "tier-m/fp32" = 1.0 }', "unknown key 'latency'", "latency_ms"),
    ],
)
def test_bad_measured_table(tmp_path: Path, measured: str, key: str, fix: str) -> None:
    err = load_error(tmp_path, BASE + "\n[measured]\n" + measured + "\n")
    assert "[measured]" in err.message and key in err.message
    assert err.hint is not None and fix in err.hint


# -- the built-in profiles -------------------------------------------------------------------


def test_builtins_are_the_required_set() -> None:
    assert set(BUILTINS) <= set(list_profiles())
    assert list(list_profiles()) == sorted(list_profiles())


@pytest.mark.parametrize("name", list_profiles())
def test_builtin_loads_and_cites_its_spec_sheet(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    text = (builtin_dir() / f"{name}.toml").read_text()
    comments = " ".join(line for line in text.splitlines() if line.startswith("#"))
    assert re.search(r"[a-z0-9-]+\.(com|org|net|io)\b", comments), "names the spec sheet it comes from"
    assert profile.hardware.cpu.split()[0] in comments


def test_builtin_figures_match_the_spec_sheets() -> None:
    hw = {n: load_profile(n).hardware for n in BUILTINS}
    assert (hw["rpi-zero-2w"].cores, hw["rpi-zero-2w"].clock_ghz, hw["rpi-zero-2w"].ram_mb) == (4, 1.0, 512)
    assert (hw["rpi3b"].clock_ghz, hw["rpi3b"].ram_mb) == (1.2, 1024)
    assert (hw["rpi4-2gb"].clock_ghz, hw["rpi4-4gb"].clock_ghz) == (1.5, 1.8)
    assert (hw["rpi5-8gb"].clock_ghz, hw["rpi5-8gb"].ram_mb, hw["rpi5-8gb"].int8_dot) == (2.4, 8192, True)
    assert not any(hw[n].int8_dot for n in ("rpi-zero-2w", "rpi3b", "rpi4-2gb", "rpi4-4gb", "jetson-nano"))
    assert hw["jetson-nano"].accelerators == ("cuda-fp16",) and hw["jetson-nano"].clock_ghz == 1.43
    assert hw["x86-gateway"].arch == "x86_64" and hw["x86-gateway"].int8_dot


def test_fleet_has_weak_and_strong_links() -> None:
    uplinks = {n: load_profile(n).network.uplink_kbps for n in BUILTINS}
    assert uplinks["rpi-zero-2w"] < 1000
    assert max(uplinks.values()) / min(uplinks.values()) > 100


@pytest.mark.parametrize("name", list_profiles())
def test_dump_and_load_round_trip(tmp_path: Path, name: str) -> None:
    profile = load_profile(name)
    back = load_profile(write(tmp_path, dump_profile(profile, comment="copied\nfor a test")))
    assert back == profile
    assert parse_profile(profile.to_dict(), source="dict") == profile


def test_measured_profile_round_trips(tmp_path: Path) -> None:
    profile = replace(load_profile("rpi4-4gb"), measured=Measured(
        latency_ms={"tier-xl/fp32": 2.5, "tier-xl/int8-static": 3.1}, accuracy_drop={"int8-static": 0.25}))
    text = dump_profile(profile)
    assert '"tier-xl/int8-static" = 3.1' in text
    back = load_profile(write(tmp_path, text))
    assert back == profile and back.measured is not None
    assert back.measured.latency("xl", "int8-static") == 3.1 and back.measured.latency("m", "fp32") is None
    with pytest.raises(TypeError):  # measurements are frozen too
        back.measured.latency_ms["tier-xl/fp32"] = 1.0  # type: ignore[index]


def test_profile_is_frozen() -> None:
    profile = load_profile("rpi3b")
    with pytest.raises(AttributeError):
        profile.hardware.cores = 8  # type: ignore[misc]


def test_direct_construction_validates() -> None:
    base = load_profile("rpi3b")
    with pytest.raises(ProfileError, match=r"cores = -2"):
        replace(base.hardware, cores=-2)
    with pytest.raises(ProfileError, match=r"budgets.train_memory_mb = 900"):
        Profile(base.name, "", base.hardware, base.network, replace(base.budgets, train_memory_mb=900))


def test_profiles_package_does_not_import_torch() -> None:
    code = ("import sys\nfrom fedge.profiles import load_profile, plan\nimport fedge.profiles.cli\n"
            "plan(load_profile('rpi3b'))\nassert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the command line ------------------------------------------------------------------------


def test_cli_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["name", "cpu", "cores×GHz", "RAM", "uplink"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == set(list_profiles())
    assert "Cortex-A53 (RP3A0)" in rows["rpi-zero-2w"] and "4×1.0" in rows["rpi-zero-2w"]
    assert "512 MB" in rows["rpi-zero-2w"] and "375 kbit/s" in rows["rpi-zero-2w"]
    assert "4×2.4" in rows["rpi5-8gb"] and "8,192 MB" in rows["rpi5-8gb"] and "50 Mbit/s" in rows["rpi5-8gb"]


def test_cli_show_builtin(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "show", "jetson-nano"]) == 0
    out = capsys.readouterr().out
    for text in ("[hardware]", "[network]", "[budgets]", "Cortex-A57 (Tegra X1)", "1.43 GHz", "4,096 MiB",
                 "cuda-fp16", "200,000 kbit/s", "1024 MiB", "90 s"):
        assert text in out, text
    assert "[measured]" not in out
    # the speed model's core and where it came from
    assert "cortex-a57, 1.472 MAC/cycle/core (from hardware.cpu 'Cortex-A57 (Tegra X1)'); peak 8.4 GMAC/s" in out


def test_cli_show_path_with_measurements(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, BASE + '\n[measured]\nlatency_ms = { "tier-xl/fp32" = 2.5 }\n')
    assert main(["profile", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[measured]" in out and "tier-xl/fp32" in out and "2.5 ms" in out


def test_cli_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "plan", "rpi-zero-2w"]) == 0
    out = capsys.readouterr().out
    p = plan(load_profile("rpi-zero-2w"))
    assert f"{p.params:,} params" in out and f"{p.macs:,} MACs" in out
    rows = {line[:16].strip(): line for line in out.splitlines()}
    expected = {"model tier": p.arch, "batch size": str(p.batch_size), "local epochs": str(p.local_epochs),
                "inference quant": p.inference_quant, "upload precision": p.upload_precision,
                "generator tier": p.generator_tier, "learning rate": f"{p.lr:g}", "lr schedule": p.lr_schedule,
                "min tail batch": str(p.min_tail)}
    for label, value in expected.items():
        assert label in rows, label
        assert rows[label].split()[len(label.split())] == value
    for reason in p.reasons.values():
        assert reason in out


@pytest.mark.parametrize("name", ["rpi3b", "x86-gateway"])
def test_cli_plan_json_matches_plan(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "plan", name, "--json", "--samples", "300", "--embed-dim", "32"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == plan(load_profile(name), embed_dim=32, samples=300).to_dict()
    assert data["samples"] == 300 and data["embed_dim"] == 32


def test_cli_unknown_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "plan", "raspberry"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'raspberry'" in err
    assert all(name in err for name in BUILTINS)


def test_cli_bad_file_names_file_key_and_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, edit("cores = 4", "cores = 0"))
    assert main(["profile", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "cores = 0" in err and "fix:" in err


def test_cli_profile_without_action(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile"]) == 2
    assert "list" in capsys.readouterr().out
