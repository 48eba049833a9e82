"""Device health: the record a device publishes on its heartbeat, the check it must pass at the coordinator,
and the way over a real Mosquitto — good records are stored, hostile ones refused and counted by reason."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest

from fedge.common.health import FIELDS, HealthError, parse_health
from fedge.common.messages import Message
from fedge.common.rounds import DeviceInfo
from fedge.common.tensorcodec import Payload, encode
from fedge.common.transport import Inbound
from fedge.edge import health as edge_health
from fedge.edge.health import HealthSampler, Heartbeat
from fedge.mqtt.broker import MosquittoProcess
from fedge.mqtt.client import new_paho_client
from fedge.mqtt.coordinator_transport import MqttCoordinatorTransport
from fedge.mqtt.device_transport import MqttDeviceTransport
from fedge.mqtt.topics import FleetTopics
from fedge.observe.monitor import FleetMonitor


def record(**over: Any) -> dict[str, Any]:
    rec = HealthSampler("tier-m").sample(last_round=3, model_round=2, last_error=None)
    rec.update(over)
    return rec


def health_bytes(rec: Any, *, sender: str = "d1", fleet: str = "f", kind: str = "health") -> bytes:
    return Message(kind, sender, 3, fleet, info={"health": rec}).to_bytes()  # type: ignore[arg-type]


def raw_message(info_json: str, *, sender: str = "d1", fleet: str = "f") -> bytes:
    """A health message whose info is exactly ``info_json`` (what a hostile device can send)."""
    meta = {"fedge.v": "1", "fleet": fleet, "round": "3", "msg_id": "ab" * 16, "sender": sender, "kind": "health",
            "info": info_json}
    return encode(Payload({}, meta))


def monitor(devices: tuple[str, ...] = ("d1", "d2")) -> FleetMonitor:
    return FleetMonitor(fleet="f", method="fedproto", total_rounds=2,
                        fleet_devices={d: DeviceInfo(d, "tier-m", "rpi4-4gb") for d in devices}, wait_log_s=0)


# -- the schema ---------------------------------------------------------------------------------

def test_the_sampler_fills_every_field_within_its_bounds_on_this_machine() -> None:
    cpu0, wall0 = time.process_time(), time.monotonic()
    s = HealthSampler("tier-m")
    end = time.process_time() + 0.2
    while time.process_time() < end:  # burn CPU so the agent's CPU share is measurable
        pass
    rec = s.sample(last_round=4, model_round=3, last_error="x" * 1000)
    # this process's share of a core over the sampler's interval, as measured here; on a loaded machine the
    # 0.2 s of CPU take longer than 0.2 s of wall time, so the share is below 100 %, not a fixed figure
    share = 100 * (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert set(rec) == set(FIELDS)
    parsed = parse_health(rec)
    assert parsed.seq == 1 and parsed.last_round == 4 and parsed.model_round == 3
    assert parsed.last_error == "x" * 256  # cut by the device to the schema's limit
    # this is a Linux machine: /proc answers these
    assert parsed.rss_bytes is not None and 10 << 20 < parsed.rss_bytes < 8 << 30
    assert parsed.mem_total_bytes is not None and parsed.mem_available_bytes is not None
    assert 0 < parsed.mem_available_bytes <= parsed.mem_total_bytes
    assert parsed.cpu_percent == pytest.approx(share, rel=0.2, abs=3), (parsed.cpu_percent, share)
    assert parsed.disk_free_bytes is not None and parsed.disk_free_bytes > 0
    assert parsed.uptime_s is not None and parsed.uptime_s > 0


def test_sensors_read_from_a_fake_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Raspberry Pi's files: thermal zones (the CPU's chosen), cpufreq, the firmware's throttle flags, a
    cgroup v2 memory limit lower than the machine's RAM."""
    sys_ = tmp_path / "sys"
    for i, (kind, milli) in enumerate((("gpu-thermal", 71000), ("cpu-thermal", 64500))):
        z = sys_ / f"class/thermal/thermal_zone{i}"
        z.mkdir(parents=True)
        (z / "type").write_text(kind + "\n")
        (z / "temp").write_text(f"{milli}\n")
    f = sys_ / "devices/system/cpu/cpu0/cpufreq"
    f.mkdir(parents=True)
    (f / "scaling_cur_freq").write_text("600000\n")
    (f / "cpuinfo_max_freq").write_text("1500000\n")
    fw = sys_ / "devices/platform/soc/soc:firmware"
    fw.mkdir(parents=True)
    (fw / "get_throttled").write_text("50005\n")
    cg = sys_ / "fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text(str(432 << 20) + "\n")
    (cg / "memory.current").write_text(str(400 << 20) + "\n")
    monkeypatch.setattr(edge_health, "SYS", sys_)
    monkeypatch.setattr(edge_health, "PI_THROTTLED", fw / "get_throttled")
    rec = parse_health(HealthSampler("tier-m").sample(last_round=0, model_round=0, last_error=None))
    assert rec.cpu_temp_c == 64.5  # the CPU zone, not the hotter GPU zone
    assert (rec.cpu_mhz, rec.cpu_max_mhz) == (600.0, 1500.0)
    assert rec.throttled == 0x50005
    assert rec.throttle_words() == ["under-voltage", "throttled", "under-voltage occurred", "throttling occurred"]
    assert rec.mem_total_bytes == 432 << 20 and rec.mem_available_bytes == 32 << 20


@pytest.mark.parametrize(("change", "reason"), [
    ({"rss_bytes": "12 MB"}, "malformed"),  # wrong type
    ({"seq": True}, "malformed"),  # a bool is not a number here
    ({"cpu_percent": [1, 2]}, "malformed"),
    ({"cpu_temp_c": {"a": {"b": 1}}}, "malformed"),  # nesting
    ({"rss_bytes": 1.5}, "malformed"),  # a float where an integer belongs
    ({"rss_bytes": 10 ** 30}, "range"),  # huge
    ({"disk_free_bytes": 2 ** 53 + 1}, "range"),  # no integer above 2^53: JSON readers would round it
    ({"cpu_temp_c": 1e300}, "range"),
    ({"cpu_percent": -1.0}, "range"),
    ({"model": "m" * 65}, "malformed"),
    ({"last_error": "e" * 257}, "malformed"),
    ({"extra_field": 1}, "malformed"),
    ({"seq": None}, "malformed"),  # required
])
def test_a_bad_record_is_refused_with_its_reason(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(HealthError) as err:
        parse_health(record(**change))
    assert err.value.reason == reason


def test_a_record_without_required_fields_or_not_an_object_is_refused() -> None:
    rec = record()
    del rec["model"]
    with pytest.raises(HealthError, match="lacks model"):
        parse_health(rec)
    for bad in ([1, 2], "ok", None, 3):
        with pytest.raises(HealthError, match="must be an object"):
            parse_health(bad)
    assert math.isnan(float("nan"))  # (NaN cannot pass JSON: see the monitor test below)


# -- the monitor's boundary ------------------------------------------------------------------

def test_the_monitor_stores_good_records_and_counts_every_bad_one_by_reason() -> None:
    mon = monitor()
    good = record(seq=5)
    assert mon.add_health(Inbound(health_bytes(good), "d1", time.time()))
    hostile = {
        "health-malformed": [
            raw_message('{"health": {"seq": NaN}}'),  # NaN
            raw_message('{"health": {"seq": 1e999}}'),  # overflows to infinity
            raw_message('{"health": ' + "[" * 3000 + "]" * 3000 + "}"),  # deep nesting (6 KB: under the size limit)
            raw_message('{"health": 1' + "0" * 60 + "}"),  # an integer of 61 digits
            raw_message(json.dumps({"health": {**good, "rss_bytes": "lots"}})),
            b"\x00" * 40,  # not a message at all
            health_bytes(good)[:-3] + b"}}}",
        ],
        "health-range": [raw_message(json.dumps({"health": {**good, "rss_bytes": 2 ** 62}}))],
        "health-oversize": [raw_message(json.dumps({"health": good, "pad": "x" * 20000}))],
        "health-kind": [Message("hello", "d1", 0, "f").to_bytes()],
        "health-fleet": [health_bytes(good, fleet="other")],
        "health-spoofed": [health_bytes(good, sender="d2")],  # on d1's topic
    }
    for items in hostile.values():
        for data in items:
            assert not mon.add_health(Inbound(data, "d1", time.time()))
    assert not mon.add_health(Inbound(health_bytes(good, sender="stranger"), "stranger", time.time()))
    assert not mon.add_health(Inbound(b"", "d2", time.time(), reject=("oversize", "a 9000-byte health message")))
    expected = {k: len(v) for k, v in hostile.items()}
    expected["health-unauthorized"] = 1
    expected["health-oversize"] += 1
    assert dict(mon.health_refused) == expected
    d1 = mon.devices["d1"]
    assert d1.health is not None and d1.health.seq == 5 and d1.health.rss_bytes == good["rss_bytes"]
    assert sum(d1.health_refused.values()) == sum(len(v) for v in hostile.values())
    assert "stranger" not in mon.devices  # a stranger's heartbeat makes no entry
    view = mon.view()
    assert view["totals"]["health_refused"] == expected and view["totals"]["health_accepted"] == 1


def test_an_older_heartbeat_does_not_replace_a_newer_one() -> None:
    mon = monitor()
    now = time.time()
    assert mon.add_health(Inbound(health_bytes(record(seq=7, sent=now)), "d1", now))
    assert not mon.add_health(Inbound(health_bytes(record(seq=6, sent=now - 10)), "d1", now))
    assert mon.devices["d1"].health is not None and mon.devices["d1"].health.seq == 7
    # a restarted agent counts from 1 again, with a newer clock: taken
    assert mon.add_health(Inbound(health_bytes(record(seq=1, sent=now + 5)), "d1", now + 5))



def test_refused_heartbeats_are_logged_once_a_minute_per_device_and_once_for_all_strangers(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every bad heartbeat is counted; the log gets one line per device per minute and one per minute for all
    senders outside the fleet together (a stranger may cycle through names), with what was held back."""
    now = [1000.0]
    mon = FleetMonitor(fleet="f", method="fedproto", total_rounds=2, wait_log_s=0, clock=lambda: now[0],
                       fleet_devices={"d1": DeviceInfo("d1", "tier-m", "rpi4-4gb")})
    caplog.set_level(logging.WARNING, logger="fedge.observe.heartbeats")
    bad = raw_message('{"health": {"seq": NaN}}')
    for i in range(20):
        assert not mon.add_health(Inbound(bad, "d1", now[0]))
        stranger = f"intruder-{i}\nWARNING forged line"
        assert not mon.add_health(Inbound(health_bytes(record(), sender=stranger), stranger, now[0]))
    lines = [r.getMessage() for r in caplog.records]
    assert dict(mon.health_refused) == {"health-malformed": 20, "health-unauthorized": 20}
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused a heartbeat from d1 (health-malformed): ")
    assert lines[1] == ("refused a heartbeat from 'intruder-0\\nWARNING forged line' (health-unauthorized): "
                        "'intruder-0\\nWARNING forged line' is not a device of this fleet")
    assert all("\n" not in line for line in lines)  # a name from a topic cannot start a line of its own
    now[0] += 61
    assert not mon.add_health(Inbound(bad, "d1", now[0]))
    assert not mon.add_health(Inbound(health_bytes(record(), sender="x"), "x", now[0]))
    later = [r.getMessage() for r in caplog.records][2:]
    assert len(later) == 2 and later[0].endswith(" (19 more since the last such line)"), later
    assert later[1].endswith(" (19 more since the last such line)"), later
    assert mon.devices["d1"].health_refused == {"health-malformed": 21}
    assert set(mon.devices) == {"d1"}  # strangers make no entry


def test_what_a_device_says_reaches_the_page_escaped_and_metrics_parseable() -> None:
    """A record's text is the device's to choose: on the page it is text, never markup; /api/state is JSON;
    /metrics stays valid exposition text (no device text is a label or a value there)."""
    from prometheus_client.parser import text_string_to_metric_families

    from fedge.observe.dashboard import monitor_routes
    from fedge.observe.metrics import FleetMetrics

    mon = monitor()
    evil = '<script>alert("x")</script><img src=x onerror=alert(1)> "quoted" \\ back\nslash'
    rec = record(last_error=evil, model='<b>tier-m</b>"', fedge_version="1.0\n# TYPE x counter")
    assert mon.add_health(Inbound(health_bytes(rec), "d1", time.time()))
    metrics = FleetMetrics(mon)
    routes = monitor_routes(mon, metrics.render)
    page = routes.page(False)
    assert "<script>alert" not in page and "<img src=x" not in page and "<b>tier-m" not in page
    assert '&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;' in page
    assert page.count("<script") == 1  # the page's own /dashboard.js, nothing else
    state = json.loads(json.dumps(routes.state()))
    d1 = next(d for d in state["devices"] if d["device"] == "d1")
    assert d1["health"]["last_error"] == evil
    text = metrics.render().decode()
    assert "alert" not in text and "TYPE x counter" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    rss = [s for s in families["fedge_device_rss_bytes"].samples if s.labels["device"] == "d1"]
    assert [s.value for s in rss] == [float(rec["rss_bytes"])]

# -- over Mosquitto -------------------------------------------------------------------------------

def test_heartbeats_over_mosquitto_and_hostile_ones_from_a_raw_client(mosquitto: MosquittoProcess) -> None:
    topics = FleetTopics("f")
    coord = MqttCoordinatorTransport(mosquitto.settings(), "f").start()
    dev = MqttDeviceTransport(mosquitto.settings(), "f", "d1").start()
    mon = monitor()
    mon.transport = coord
    beat = Heartbeat("d1", "f", HealthSampler("tier-m"), dev.send_health, lambda: (2, 1, "round failed: x"),
                     interval_s=0.2).start()
    raw = new_paho_client("hostile", True)
    raw.connect("127.0.0.1", mosquitto.port)
    raw.loop_start()
    try:
        deadline = time.time() + 15
        while time.time() < deadline and mon.devices["d1"].health is None:
            mon.tick()
            time.sleep(0.1)
        first = mon.devices["d1"].health
        assert first is not None and first.last_round == 2 and first.model_round == 1
        assert first.last_error == "round failed: x" and first.model == "tier-m"
        beat.stop()
        hostile = [raw_message('{"health": {"seq": NaN}}'), raw_message('{"health": ' + "[" * 100 + "]" * 100 + "}"),
                   b"garbage", b"x" * 20000, raw_message(json.dumps({"health": {**record(), "cpu_temp_c": 1e308}}))]
        for data in hostile:
            raw.publish(topics.health("d1"), data, qos=1).wait_for_publish(5)
        raw.publish(topics.health("d2"), health_bytes(record(), sender="d1"), qos=1).wait_for_publish(5)
        deadline = time.time() + 10
        while time.time() < deadline and sum(mon.health_refused.values()) < len(hostile) + 1:
            mon.tick()
            time.sleep(0.1)
        assert dict(mon.health_refused) == {"health-malformed": 3, "health-oversize": 1, "health-range": 1,
                                            "health-spoofed": 1}
        assert mon.devices["d1"].health is not None and mon.devices["d1"].health.seq >= first.seq
        assert mon.devices["d2"].health is None
        assert "d1" in coord.last_seen() and coord.statuses()["d1"][0] is True
    finally:
        beat.stop()
        raw.loop_stop()
        raw.disconnect()
        dev.close()
        coord.close()
    assert isinstance(paho.MQTT_ERR_SUCCESS, int)


def test_an_error_text_never_carries_the_devices_data_path() -> None:
    """A round failure naming a file of the device's own data folder: the heartbeat says <data> instead."""
    from types import SimpleNamespace

    from fedge.common.transport import DeviceTransport
    from fedge.edge.service import EdgeOptions, EdgeService

    class Quiet(DeviceTransport):
        def send_hello(self, data: bytes) -> None: ...
        def current_round(self) -> bytes | None: return None
        def fetch_global(self, artifact: str) -> bytes | None: return None
        def send_update(self, data: bytes) -> None: ...

    agent = SimpleNamespace(device=DeviceInfo("d1", "tier-m", "rpi4-4gb"), fleet="f", last_round=2, model_round=1)
    svc = EdgeService(agent, Quiet(), EdgeOptions(private_paths=("photos", "/srv/cam/photos")))  # type: ignore[arg-type]
    svc.last_error = "round failed: /srv/cam/photos/cat/1.png is truncated; photos/dog is empty"
    assert svc._health_state() == (2, 1, "round failed: <data>/cat/1.png is truncated; <data>/dog is empty")
