"""The device speed model (issue 27, item 0): per-microarchitecture efficiency, the size curve, [measured]."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedge.common.archs import TIERS, arch_by_name, tier_arch
from fedge.errors import ProfileError
from fedge.profiles import Hardware, Measured, load_profile, parse_profile
from fedge.profiles.speed import CURVE_BATCHES, SIZE_CURVE, size_fraction, speed_model
from fedge.profiles.uarch import UARCHES, Uarch, uarch_of


def rate(name: str, tier: str = "m", batch: int = 64) -> float:
    return speed_model(load_profile(name)).mac_rate(tier_arch(tier), batch)


def test_published_figures_give_the_per_cycle_rates() -> None:
    # HPL GFLOPS / (cores x GHz) of the boards the comments cite
    assert UARCHES["cortex-a72"].mac_per_cycle == pytest.approx(11.774 / 7.2, abs=1e-3)
    assert UARCHES["cortex-a76"].mac_per_cycle == pytest.approx(37.888 / 9.6, abs=1e-3)
    assert UARCHES["gracemont"].mac_per_cycle == pytest.approx(62.851 / 13.6, abs=1e-3)
    # A53 from Geekbench 5 single-core per GHz relative to the A72
    assert UARCHES["cortex-a53"].mac_per_cycle == pytest.approx(1.635 * (108 / 1.4) / (271 / 1.8), abs=1e-3)
    assert all(u.source for u in UARCHES.values())


@pytest.mark.parametrize(("tier", "batch"), [("xs", 16), ("m", 64), ("xl", 64)])
def test_builtins_in_the_published_order(tier: str, batch: int) -> None:
    """Pi Zero 2 W < Pi 3 < Pi 4 ≈ Jetson Nano < Pi 5 < N100 gateway, on every model size."""
    r = {n: rate(n, tier, batch) for n in ("rpi-zero-2w", "rpi3b", "rpi4-4gb", "jetson-nano", "rpi5-8gb",
                                           "x86-gateway")}
    assert r["rpi-zero-2w"] < r["rpi3b"] < r["jetson-nano"] < r["rpi4-4gb"] < r["rpi5-8gb"] < r["x86-gateway"]
    assert 1 / 1.5 <= r["jetson-nano"] / r["rpi4-4gb"] <= 1.5  # "≈": same NEON width, a lower clock
    # Pi 5 vs Pi 4: HPL says 3.2x (37.9 vs 11.8 GFLOPS) on the whole board
    assert r["rpi5-8gb"] / r["rpi4-4gb"] == pytest.approx(37.888 / 11.774, rel=1e-3)
    # the old model (GHz x cores x one constant) made the Pi 4 only 1.8x a Zero 2 W; Geekbench 5 says ~3.5x
    assert r["rpi4-4gb"] / r["rpi-zero-2w"] > 3


def test_uarch_from_cpu_string_or_explicit_key() -> None:
    def hw(cpu: str, arch: str = "aarch64", uarch: str = "") -> Hardware:
        return Hardware(arch, cpu, 4, 1.5, 4096, False, (), uarch)

    def of(h: Hardware) -> tuple[Uarch, str]:
        return uarch_of(h.arch, h.cpu, h.uarch)

    assert of(hw("Cortex-A72 (BCM2711)"))[0].name == "cortex-a72"
    assert of(hw("BCM2712"))[0].name == "cortex-a76"
    assert of(hw("Intel N100", "x86_64"))[0].name == "gracemont"
    assert of(hw("Cortex-A53", uarch="cortex-a76"))[0].name == "cortex-a76"  # the explicit key wins
    got, how = of(hw("Mystery SoC"))
    assert got.name == "cortex-a53" and "assumed" in how and "hardware.uarch" in how
    with pytest.raises(ProfileError) as err:
        hw("Cortex-A72", uarch="cortex-72")
    assert "uarch = 'cortex-72'" in err.value.message and "did you mean 'cortex-a72'" in (err.value.hint or "")


def test_uarch_key_loads_and_round_trips() -> None:
    d = load_profile("rpi4-4gb").to_dict()
    d["hardware"]["uarch"] = "cortex-a76"
    p = parse_profile(d, source="test")
    assert p.hardware.uarch == "cortex-a76" and parse_profile(p.to_dict(), source="again") == p
    assert speed_model(p).uarch.name == "cortex-a76"


def test_size_curve_grows_with_model_and_batch() -> None:
    for lanes, rows in SIZE_CURVE.items():
        for tier in TIERS:
            assert list(rows[tier]) == sorted(rows[tier]), (lanes, tier)  # never slower with a larger batch
        # a small model uses a fraction of what a large one does (fewer lanes, more overhead per MAC)
        assert rows["xs"][-1] < rows["m"][-1] < rows["xl"][-1], lanes
    # interpolation hits the measured points and stays between them
    m = tier_arch("m").macs()
    for i, b in enumerate(CURVE_BATCHES):
        assert size_fraction(m, b, 4) == pytest.approx(SIZE_CURVE[4]["m"][i])
    assert SIZE_CURVE[4]["m"][1] <= size_fraction(m, 24, 4) <= SIZE_CURVE[4]["m"][2]
    assert size_fraction(m, 512, 4) == pytest.approx(SIZE_CURVE[4]["m"][-1])  # beyond the range: the end
    # a GeFL network between two tiers in MACs gets a fraction between theirs
    cnn = arch_by_name("cnn3")
    lo, hi = sorted(size_fraction(tier_arch(t).macs(), 64, 4) for t in TIERS)[0], 1.0
    assert lo <= size_fraction(cnn.macs(), 64, 4) <= hi


def test_measured_training_rate_overrides_the_model() -> None:
    base = load_profile("rpi4-4gb")
    model = speed_model(base)
    m, xl = tier_arch("m"), tier_arch("xl")
    measured = replace(base, measured=Measured(train_gmac_s={"tier-m@64": 2.0}))
    s = speed_model(measured)
    assert s.mac_rate(m, 64) == pytest.approx(2.0e9)  # the measured point itself
    # elsewhere the model, rescaled by how far it was off at the nearest measured point
    ratio = 2.0e9 / model.mac_rate(m, 64)
    assert s.mac_rate(xl, 64) == pytest.approx(model.mac_rate(xl, 64) * ratio)
    assert s.mac_rate(m, 16) == pytest.approx(model.mac_rate(m, 16) * ratio)
    # the round's fixed costs (2,200 MAC equivalents per parameter) at the measured rate too
    assert s.train_seconds(m, 64, samples=600, epochs=5) == pytest.approx((3 * m.macs() * 3000
                                                                           + 2200 * m.num_params()) / 2.0e9)
    # ... unless the device measured them
    own = replace(base, measured=Measured(train_gmac_s={"tier-m@64": 2.0}, round_fixed_s=0.4))
    assert speed_model(own).train_seconds(m, 64, samples=600, epochs=5) == pytest.approx(
        3 * m.macs() * 3000 / 2.0e9 + 0.4)


@pytest.mark.parametrize(("table", "needle"), [
    ({"tier-q@64": 1.0}, "is not a <model tier>@<batch> key"),
    ({"tier-m/64": 1.0}, "is not a <model tier>@<batch> key"),
    ({"tier-m@0": 1.0}, "is not a <model tier>@<batch> key"),
    ({"tier-m@64": 0}, "must be a positive number"),
])
def test_bad_measured_training_rates_are_refused(table: dict[str, float], needle: str) -> None:
    d = load_profile("rpi4-4gb").to_dict()
    d["measured"] = {"train_gmac_s": table}
    with pytest.raises(ProfileError) as err:
        parse_profile(d, source="my.toml")
    assert needle in err.value.message
