"""The one byte formatter shared by the simulator's tables and `fedge emulate status`."""

import pytest

from fedge.common.units import format_bytes


@pytest.mark.parametrize(("n", "binary", "text"), [
    (0, True, "0 B"), (1023, True, "1023 B"), (1024, True, "1.0 KiB"), (1536, True, "1.5 KiB"),
    (5 * 1024**2, True, "5.0 MiB"), (3 * 1024**4, True, "3072.0 GiB"),
    (999, False, "999 B"), (1000, False, "1.0 kB"), (61486, False, "61.5 kB"), (2.5e9, False, "2.5 GB"),
])
def test_units_switch_at_the_base_and_the_largest_unit_absorbs_the_rest(n: float, binary: bool, text: str) -> None:
    assert format_bytes(n, binary=binary) == text
