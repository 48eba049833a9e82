"""``fedge edge run --health-override FILE`` (and ``$FEDGE_HEALTH_OVERRIDE``): a JSON file whose fields replace the
sensors' readings in the device's health records — how tests and ``fedge emulate fault throttle`` make a device
report itself hot. Checked like any device input: a malformed file is refused naming the file and the field."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from fedge.common.health import parse_health
from fedge.edge.health import HEALTH_OVERRIDE_ENV, HealthOverride, HealthSampler, health_override
from fedge.errors import ConfigError


def sample(override: HealthOverride | None) -> dict:
    return HealthSampler("tier-m", override=override).sample(last_round=1, model_round=1, last_error=None)


def test_the_file_overrides_the_readings_while_it_exists(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    ov = HealthOverride(path)
    real = sample(ov)  # no file yet: the sensors' readings
    path.write_text(json.dumps({"cpu_temp_c": 84.5, "throttled": "0x50006", "cpu_mhz": 600}))
    rec = sample(ov)
    assert (rec["cpu_temp_c"], rec["throttled"], rec["cpu_mhz"]) == (84.5, 0x50006, 600.0)
    assert parse_health(rec).throttle_words() == ["arm frequency capped", "throttled", "under-voltage occurred",
                                                  "throttling occurred"]
    path.write_text(json.dumps({"throttled": 0x50000}))  # resumed: the flags remember, nothing now
    assert sample(ov)["throttled"] == 0x50000
    path.unlink()  # gone: the real readings again
    assert sample(ov)["throttled"] == real["throttled"] and sample(ov)["cpu_temp_c"] == real["cpu_temp_c"]


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ('{"cpu_temp": 80}', "unknown field 'cpu_temp'"),
    ('{"rss_bytes": 1}', "unknown field 'rss_bytes'"),
    ('{"cpu_temp_c": "hot"}', "cpu_temp_c must be a number, got str"),
    ('{"cpu_temp_c": 900}', "cpu_temp_c = 900 is outside [-100, 200]"),
    ('{"throttled": "0xzz"}', "throttled = '0xzz' is not a number"),
    ('{"throttled": -1}', "throttled = -1 is outside"),
])
def test_a_malformed_file_is_refused_naming_the_file_and_the_field(tmp_path: Path, content: str,
                                                                   message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        HealthOverride(path).read()
    assert err.value.message.startswith(f"health override {path}: ") and message in err.value.message


def test_at_start_a_bad_file_fails_and_later_one_is_logged_once_and_ignored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "h.json"
    path.write_text('{"throttled": 6, "fan": 1}')
    monkeypatch.setenv(HEALTH_OVERRIDE_ENV, str(path))
    with pytest.raises(ConfigError, match="unknown field 'fan'"):
        health_override(None)  # the environment's file, checked at start
    path.write_text('{"throttled": 6}')
    ov = health_override(None)
    assert ov is not None and ov.path == path and sample(ov)["throttled"] == 6
    assert health_override(str(tmp_path / "other.json")) is not None  # the flag wins; absent is fine at start
    path.write_text('{"throttled": 6, "fan": 1}')  # broken while running: real readings, one warning
    with caplog.at_level(logging.WARNING, logger="fedge.edge.health"):
        recs = [sample(ov) for _ in range(3)]
    assert all(r["throttled"] == sample(None)["throttled"] != 6 for r in recs)  # the sensors' (None off a Pi)
    warnings = [r.getMessage() for r in caplog.records if "health override" in r.getMessage()]
    assert len(warnings) == 1 and "unknown field 'fan'" in warnings[0] and "real readings" in warnings[0]
    monkeypatch.delenv(HEALTH_OVERRIDE_ENV)
    assert health_override(None) is None


def test_fedge_edge_run_refuses_a_malformed_override_before_it_connects(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_text('{"cpu_temp_c": null, "throttled": true}')
    out = subprocess.run([sys.executable, "-m", "fedge", "edge", "run", "--health-override", str(path),
                          "--config", "none.toml", "--device-id", "x", "--broker", "mqtt://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"health override {path}: throttled must be a number, got bool" in out.stderr
