"""``/metrics``: the Prometheus exposition of a real fleet's run, scraped by a real Prometheus server whose query
API returns the series with the numbers of the round reports; and the web server's rules: loopback unless a
token, the token on every request, read-only, no secret in what it serves."""

from __future__ import annotations

import base64
import json
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from observe_helpers import Prometheus, run_watched, small_fleet
from prometheus_client.parser import text_string_to_metric_families

from fedge.coordinator.store import REPORTS_FILE, read_reports
from fedge.errors import ConfigError
from fedge.mqtt.broker import MosquittoProcess
from fedge.observe.dashboard import monitor_routes
from fedge.observe.web import DashboardServer, Endpoint, Routes, check_bind, load_token, parse_endpoint


def get(url: str, token: str | None = None, *, basic: bool = False, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method)
    if token is not None:
        req.add_header("Authorization", f"Basic {base64.b64encode(f'me:{token}'.encode()).decode()}" if basic
                       else f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


# -- the server's rules -----------------------------------------------------------------------------

def test_binding_beyond_loopback_needs_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDGE_HTTP_TOKEN", raising=False)
    assert parse_endpoint("8321") == Endpoint("127.0.0.1", 8321)
    assert parse_endpoint(":0") == Endpoint("127.0.0.1", 0)
    assert parse_endpoint("[::1]:9") == Endpoint("::1", 9)
    for host in ("0.0.0.0", "192.168.1.5", "::", "coordinator.lan"):
        with pytest.raises(ConfigError, match=f"refusing to serve the dashboard and /metrics on {host}:8321 "
                                              "without a token"):
            check_bind(Endpoint(host, 8321), load_token(None))
    for host in ("127.0.0.1", "127.9.9.9", "::1", "localhost"):
        check_bind(Endpoint(host, 8321), None)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="at least 16"):
        load_token(str(short))
    good = tmp_path / "token"
    good.write_text("t" * 20 + "\n")
    check_bind(Endpoint("0.0.0.0", 8321), load_token(str(good)))
    monkeypatch.setenv("FEDGE_HTTP_TOKEN", "e" * 16)
    assert load_token(None) == "e" * 16


def test_a_token_is_printable_ascii_and_its_file_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A token a header cannot carry unchanged is refused; one in a file others may read works, with a warning
    that never shows the token."""
    monkeypatch.delenv("FEDGE_HTTP_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="fedge.observe.web")
    for bad in ("with a space inside 123", "tab\there-and-more-chars", "ümlaut-is-not-ascii-token"):
        monkeypatch.setenv("FEDGE_HTTP_TOKEN", bad)
        with pytest.raises(ConfigError, match="must be printable ASCII without spaces"):
            load_token(None)
    monkeypatch.delenv("FEDGE_HTTP_TOKEN")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe" * 20)
    with pytest.raises(ConfigError, match=r"cannot read the HTTP token file .*: it is not UTF-8 text"):
        load_token(str(binary))
    with pytest.raises(ConfigError, match=r"cannot read the HTTP token file .*: No such file or directory"):
        load_token(str(tmp_path / "missing"))
    token = "s3cret-" + "k" * 20
    private, shared = tmp_path / "private", tmp_path / "shared"
    for f, mode in ((private, 0o600), (shared, 0o644)):
        f.write_text(token + "\nsecond line ignored\n")
        f.chmod(mode)
    assert load_token(str(private)) == token and not caplog.records
    assert load_token(str(shared)) == token
    assert [r.getMessage() for r in caplog.records] == [
        f"the HTTP token file {shared} may be read by other users (mode 644): chmod 600 {shared}"]


def test_an_idle_connection_is_closed_and_the_server_still_answers() -> None:
    """A client that opens a connection and sends nothing holds its thread only until the request timeout."""
    routes = Routes(page=lambda _: "<p>page</p>", fragment=lambda _: "", state=dict)
    server = DashboardServer(routes, Endpoint("127.0.0.1", 0), request_timeout_s=0.5).start()
    try:
        host, port = server.httpd.server_address[:2]
        idle = socket.create_connection((str(host), port), timeout=10)
        t0 = time.monotonic()
        assert idle.recv(1) == b""  # the server closed it
        assert 0.4 < time.monotonic() - t0 < 5
        idle.close()
        assert get(server.url + "/") == (200, b"<p>page</p>")
    finally:
        server.stop()


def test_stopping_lets_a_response_under_way_finish_and_refuses_new_ones() -> None:
    """The coordinator stops its server as the run ends; a page being built then (a last scrape) still arrives
    whole: a process that exited mid-response cut a client's read short (http.client.IncompleteRead)."""
    building, release = threading.Event(), threading.Event()
    body = "x" * 200_000

    def slow_page(_: bool) -> str:
        building.set()
        release.wait(10)
        return body

    server = DashboardServer(Routes(page=slow_page, fragment=lambda _: "", state=dict),
                             Endpoint("127.0.0.1", 0)).start()
    got: list[tuple[int, bytes]] = []
    client = threading.Thread(target=lambda: got.append(get(server.url + "/")))
    client.start()
    assert building.wait(10)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    time.sleep(1.5)  # shutdown() itself takes up to one poll interval (0.5 s)
    assert stopper.is_alive()  # stop() waits for the response under way
    release.set()
    stopper.join(10)
    client.join(10)
    assert not stopper.is_alive() and got == [(200, body.encode())]
    with pytest.raises(urllib.error.URLError):  # the socket is closed: nothing new is served
        urllib.request.urlopen(server.url + "/healthz", timeout=5)


def test_the_coordinator_command_refuses_a_public_address_without_a_token(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli import main

    monkeypatch.delenv("FEDGE_HTTP_TOKEN", raising=False)
    cfg = small_fleet(tmp_path, "public")
    code = main(["coordinator", "run", "--config", cfg.source, "--state-dir", str(tmp_path / "s"),
                 "--broker", "mqtt://127.0.0.1:1", "--http", "0.0.0.0:8321"])
    err = capsys.readouterr().err
    assert code == ConfigError.exit_code
    assert "refusing to serve the dashboard and /metrics on 0.0.0.0:8321 without a token" in err
    assert "Traceback" not in err


def test_metrics_of_a_real_run_scraped_by_prometheus(tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    cfg = small_fleet(tmp_path, "scraped")
    run = run_watched(cfg, mosquitto, state_dir=tmp_path / "state")
    reports = read_reports(tmp_path / "state" / REPORTS_FILE)
    assert len(reports) == 3 and [len(r.accepted) for r in reports] == [3, 3, 3]
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    server = DashboardServer(monitor_routes(run.monitor, run.metrics.render), Endpoint("127.0.0.1", 0),
                             token).start()
    prom = Prometheus(tmp_path, server.url.removeprefix("http://"), token_file=token_file)
    try:
        # the rules: the token on every request (bearer or basic), read-only
        assert get(server.url + "/metrics")[0] == 401
        assert get(server.url + "/metrics", "x" * 30)[0] == 401
        assert get(server.url + "/", token, basic=True)[0] == 200
        assert get(server.url + "/metrics", token, method="POST")[0] == 405
        status, text = get(server.url + "/metrics", token)
        assert status == 200
        got = samples(text)
        # the numbers of reports.jsonl
        accepted = sum(len(r.accepted) for r in reports)
        assert got[("fedge_updates_accepted_total", ())] == accepted == 9
        assert got[("fedge_bytes_up_total", ())] == sum(sum(r.bytes_up.values()) for r in reports)
        assert got[("fedge_bytes_down_total", ())] == sum(sum(r.bytes_down.values()) for r in reports)
        assert got[("fedge_rounds_completed_total", ())] == 3
        assert got[("fedge_devices", (("state", "offline"),))] == 3  # they said offline after the final round
        assert got[("fedge_round_duration_seconds_count", ())] == 3
        assert got[("fedge_aggregation_duration_seconds_count", ())] == 3
        assert got[("fedge_round_duration_seconds_sum", ())] == pytest.approx(sum(r.seconds for r in reports))
        for dev in ("rpi4-2gb-1", "rpi4-2gb-2", "x86-gateway-1"):
            profile = dev.rsplit("-", 1)[0]
            labels = (("device", dev), ("profile", profile))
            assert got[("fedge_device_last_round", labels)] == 3
            assert got[("fedge_device_accepted_updates", labels)] == 3
            h = run.monitor.devices[dev].health
            assert h is not None and got[("fedge_device_rss_bytes", labels)] == h.rss_bytes
            assert got[("fedge_device_online", labels)] == 0  # their services stopped after the final round
        assert token.encode() not in text
        # Prometheus itself: it scrapes with the token and its query API has the series
        found = prom.wait_for("fedge_updates_accepted_total")
        assert float(found[0]["value"][1]) == accepted
        assert found[0]["metric"]["job"] == "fedge"
        per_device = prom.wait_for("fedge_device_rss_bytes")
        assert sorted(s["metric"]["device"] for s in per_device) == ["rpi4-2gb-1", "rpi4-2gb-2", "x86-gateway-1"]
        buckets = prom.wait_for("fedge_round_duration_seconds_bucket")
        assert max(float(s["value"][1]) for s in buckets) == 3
        up = prom.query('up{job="fedge"}')
        assert up and float(up[0]["value"][1]) == 1.0
        assert [t["health"] for t in prom.targets()] == ["up"]
        state = json.loads(get(server.url + "/api/state", token)[1])
        assert state["totals"]["updates_accepted"] == accepted
    finally:
        prom.stop()
        server.stop()
