"""The dashboard page: one HTML page drawn on the server, charts as inline SVG, no build step, no library.

It renders a fleet view (:meth:`fedge.observe.monitor.FleetMonitor.view`: live from a coordinator, or
replayed from a state directory) as:

* the state line (the round in progress and its deadline, or what the coordinator waits for) and the
  devices it waits for, each with the reason;
* a table per profile (devices, online, accepted and refused updates, mean accuracy of the last round,
  traffic) — what stays readable at 1,000 devices;
* charts: accuracy per round per profile (mean line, min–max band), traffic per round per profile
  (stacked bars, up and down), and for fleets of at most 40 devices accuracy per round per device;
* the fleet table: every device with its profile, model, state, last seen, health, last round, updates
  accepted / missed / refused by reason (and a refused hello's words), accuracies and bytes.

In asynchronous mode (the view's ``unit`` is ``version``) the same page counts global versions instead of
rounds: the state line names the version being built, how many devices are training for it and its buffer
size, the totals line the staleness of the last version's updates, and the charts' x axis is the version.

Colours: profiles take a colour-blind-safe palette (Okabe–Ito), devices hues stepped by the golden
angle, so no two of any number of series share a colour. Everything a device sent (ids, profiles, arch
names, error texts) is HTML-escaped. The live page fetches ``/fragment`` every 2 s (``/dashboard.js``:
the only script, no inline script, so the server's CSP forbids any other).
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from fedge.common.units import format_bytes
from fedge.observe.monitor import FleetMonitor
from fedge.observe.web import Routes

REFRESH_MS = 2000
BIG_FLEET = 200  # above this many devices the page refreshes every BIG_REFRESH_MS (drawing it takes ~50 ms at 1,000)
BIG_REFRESH_MS = 5000
ROWS = 200  # device rows drawn unless ?all=1 (problems first): a browser lays 1,000 rows out in about a second
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
GOLDEN_ANGLE = 137.50776405003785
W, H = 640, 240  # chart size (px)
PAD_L, PAD_R, PAD_T, PAD_B = 62, 12, 12, 32  # left: room for "10.0 kB" beside the axis title
STATE_ORDER = {"refused": 0, "offline": 1, "no hello": 2, "online": 3, "registered": 4}

SCRIPT = """// fedge dashboard: refresh the live part of the page every few seconds (no other script runs here).
(function () {
  var live = document.getElementById('live');
  if (!live || live.dataset.live !== '1') { return; }
  var version = live.dataset.version;
  var every = parseInt(live.dataset.refresh, 10) || REFRESH_MS;
  function refresh() {
    fetch('fragment' + window.location.search, {cache: 'no-store', credentials: 'same-origin'}).then(function (r) {
      if (!r.ok) { throw new Error(r.status); }
      return r.text();
    }).then(function (text) {
      var box = document.createElement('div');
      box.innerHTML = text;
      var fresh = box.querySelector('#live');
      if (fresh && fresh.dataset.version !== version) {
        live.replaceWith(fresh);
        live = fresh;
        version = fresh.dataset.version;
      }
      document.getElementById('stale').hidden = true;
    }).catch(function () {
      document.getElementById('stale').hidden = false;
    }).finally(function () { setTimeout(refresh, every); });
  }
  setTimeout(refresh, every);
})();
""".replace("REFRESH_MS", str(REFRESH_MS))

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:20px 0 6px}
table{border-collapse:collapse}td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}
th{background:#f4f4f4;position:sticky;top:0}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.state{font-weight:600}.s-online{color:#087f23}.s-offline{color:#b00020}.s-refused{color:#b00020}
.s-no-hello{color:#8a6d00}.s-registered{color:#666}.why{color:#b00020}.muted{color:#666}
.charts{display:flex;flex-wrap:wrap;gap:16px}.chart{border:1px solid #ddd;background:#fff}
.legend{display:flex;flex-wrap:wrap;gap:4px 12px;max-width:640px;font-size:12px}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
#stale{color:#b00020}.err{color:#b00020;max-width:360px}
"""


def profile_colours(profiles: Sequence[str]) -> dict[str, str]:
    """A colour per profile: Okabe–Ito's eight, then golden-angle hues (never a repeat)."""
    out = {}
    for i, p in enumerate(sorted(profiles)):
        out[p] = OKABE_ITO[i] if i < len(OKABE_ITO) else device_colour(i)
    return out


def device_colour(i: int) -> str:
    """The i-th of an endless sequence of distinct colours: hue stepped by the golden angle, lightness alternating."""
    hue = (i * GOLDEN_ANGLE) % 360
    light = (38, 52, 64)[i % 3]
    return f"hsl({hue:.1f},70%,{light}%)"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _ago(t: float | None, now: float) -> str:
    if not t:
        return "never"
    s = max(0.0, now - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _bytes(n: float) -> str:
    return format_bytes(n, binary=False)


# -- charts ------------------------------------------------------------------------------------------

def _axes(x_max: int, y_max: float, y_label: str, y_fmt: Callable[[float], str], x_label: str = "round") -> list[str]:
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    out = [f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" fill="#fff" stroke="#bbb"/>']
    for k in range(5):
        v = y_max * k / 4
        y = PAD_T + ph - ph * k / 4
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{PAD_L - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{_e(y_fmt(v))}</text>')
    step = max(1, math.ceil(x_max / 12))
    for r in range(1, x_max + 1, step):
        x = _x(r, x_max)
        out.append(f'<text x="{x:.1f}" y="{H - PAD_B + 14}" font-size="10" text-anchor="middle">{r}</text>')
    out.append(f'<text x="{PAD_L + pw / 2:.0f}" y="{H - 4}" font-size="11" text-anchor="middle">{_e(x_label)}</text>')
    out.append(f'<text x="12" y="{PAD_T + ph / 2:.0f}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 12 {PAD_T + ph / 2:.0f})">{_e(y_label)}</text>')
    return out


def _x(r: float, x_max: int) -> float:
    pw = W - PAD_L - PAD_R
    return PAD_L + (pw * (r - 0.5) / max(1, x_max))


def _y(v: float, y_max: float) -> float:
    ph = H - PAD_T - PAD_B
    return PAD_T + ph - ph * (v / y_max if y_max else 0)


def line_chart(chart_id: str, title: str, series: list[dict[str, Any]], x_max: int, y_max: float, y_label: str,
               y_fmt: Callable[[float], str], x_label: str = "round") -> str:
    """Lines (and optional min–max bands) per series: {"label", "colour", "points": [(x, y)], "band":
    [(x, lo, hi)]}."""
    parts = [f'<svg class="chart" id="{chart_id}" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
             f'aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg"><title>{_e(title)}</title>']
    parts += _axes(x_max, y_max, y_label, y_fmt, x_label)
    for s in series:
        band = s.get("band") or []
        if len(band) > 1:
            upper = " ".join(f"{_x(x, x_max):.1f},{_y(hi, y_max):.1f}" for x, _, hi in band)
            lower = " ".join(f"{_x(x, x_max):.1f},{_y(lo, y_max):.1f}" for x, lo, _ in reversed(band))
            parts.append(f'<polygon class="band" points="{upper} {lower}" fill="{s["colour"]}" fill-opacity="0.15" '
                         'stroke="none"/>')
        pts = s["points"]
        if not pts:
            continue
        coords = " ".join(f"{_x(x, x_max):.1f},{_y(y, y_max):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" data-label="{_e(s["label"])}" points="{coords}" fill="none" '
                     f'stroke="{s["colour"]}" stroke-width="{s.get("width", 2)}"><title>{_e(s["label"])}</title>'
                     '</polyline>')
        for x, y in pts[-1:]:
            parts.append(f'<circle cx="{_x(x, x_max):.1f}" cy="{_y(y, y_max):.1f}" r="2.5" fill="{s["colour"]}"/>')
    parts.append("</svg>")
    return "".join(parts)


def bar_chart(chart_id: str, title: str, rounds: list[int], stacks: list[dict[str, Any]], y_label: str,
              y_fmt: Callable[[float], str], x_label: str = "round") -> str:
    """Stacked bars per round (or version, ``x_label``): stacks = [{"label", "colour", "values": {round: value}}]."""
    x_max = max(rounds, default=1)
    totals = {r: sum(s["values"].get(r, 0) for s in stacks) for r in rounds}
    y_max = _nice(max(totals.values(), default=1) or 1)
    parts = [f'<svg class="chart" id="{chart_id}" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
             f'aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg"><title>{_e(title)}</title>']
    parts += _axes(x_max, y_max, y_label, y_fmt, x_label)
    bw = max(1.0, (W - PAD_L - PAD_R) / max(1, x_max) * 0.7)
    for r in rounds:
        base = 0.0
        for s in stacks:
            v = s["values"].get(r, 0)
            if v <= 0:
                continue
            y0, y1 = _y(base, y_max), _y(base + v, y_max)
            parts.append(f'<rect class="bar" x="{_x(r, x_max) - bw / 2:.1f}" y="{y1:.1f}" width="{bw:.1f}" '
                         f'height="{max(0.5, y0 - y1):.1f}" fill="{s["colour"]}"><title>{_e(x_label)} {r}, '
                         f'{_e(s["label"])}: {_e(y_fmt(v))}</title></rect>')
            base += v
    parts.append("</svg>")
    return "".join(parts)


def _nice(v: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above ``v``."""
    if v <= 0:
        return 1.0
    k = 10 ** math.floor(math.log10(v))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= v)


def legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span data-label="{_e(label)}"><i class="sw" style="background:{c}"></i>{_e(label)}</span>'
        for label, c in items) + "</div>"


def charts(view: dict[str, Any]) -> str:
    unit = view["unit"]
    rounds = [r for r in view["rounds"] if r["phase"] != "final"]
    if not rounds:
        return f'<p class="muted">No {unit} has completed yet: the charts appear after the first.</p>'
    x_max = max(r["round"] for r in rounds)
    profiles = sorted({p for r in rounds for p in r["profiles"]})
    colours = profile_colours(profiles)
    out = ['<div class="charts">']
    series = []
    for p in profiles:
        pts, band = [], []
        for r in rounds:
            s = r["profiles"].get(p)
            if s and s["acc_n"]:
                pts.append((r["round"], 100 * s["acc_sum"] / s["acc_n"]))
                band.append((r["round"], 100 * s["acc_min"], 100 * s["acc_max"]))
        series.append({"label": p, "colour": colours[p], "points": pts, "band": band})
    out.append("<div><h2>Accuracy per profile</h2>" + line_chart(
        "chart-acc-profile", f"global-test accuracy per {unit}: mean per profile, band from its lowest to its highest "
        "device", series, x_max, 100, "accuracy %", lambda v: f"{v:.0f}", unit)
        + legend([(p, colours[p]) for p in profiles]) + "</div>")
    ups = [{"label": f"{p} up", "colour": colours[p],
            "values": {r["round"]: r["profiles"].get(p, {}).get("bytes_up", 0) for r in rounds}} for p in profiles]
    downs = [{"label": f"{p} down", "colour": colours[p],
              "values": {r["round"]: r["profiles"].get(p, {}).get("bytes_down", 0) for r in rounds}} for p in profiles]
    nums = [r["round"] for r in rounds]
    out.append("<div><h2>Traffic up per profile</h2>" + bar_chart(
        "chart-up-profile", f"bytes of accepted updates per {unit}, stacked by profile", nums, ups, "bytes up",
        _bytes, unit) + legend([(p, colours[p]) for p in profiles]) + "</div>")
    out.append("<div><h2>Traffic down per profile</h2>" + bar_chart(
        "chart-down-profile", f"bytes devices received per {unit}, stacked by profile", nums, downs, "bytes down",
        _bytes, unit) + legend([(p, colours[p]) for p in profiles]) + "</div>")
    if view["series"]:
        devices = sorted({d for r in rounds for d in (r["acc"] or {})})
        dev_colours = {d: device_colour(i) for i, d in enumerate(devices)}
        dev_series = [{"label": d, "colour": dev_colours[d], "width": 1.5,
                       "points": [(r["round"], 100 * r["acc"][d]) for r in rounds if r["acc"] and d in r["acc"]]}
                      for d in devices]
        out.append("<div><h2>Accuracy per device</h2>" + line_chart(
            "chart-acc-device", f"global-test accuracy per {unit} of each device", dev_series, x_max, 100,
            "accuracy %", lambda v: f"{v:.0f}", unit) + legend([(d, dev_colours[d]) for d in devices]) + "</div>")
    else:
        out.append('<p class="muted">Per-device charts are drawn for fleets of up to 40 devices; the per-profile '
                   'charts and the table below cover every device.</p>')
    out.append("</div>")
    return "".join(out)


# -- tables --------------------------------------------------------------------------------------------

def profile_table(view: dict[str, Any]) -> str:
    last = next((r for r in reversed(view["rounds"])), None)
    rows: dict[str, dict[str, Any]] = {}
    for d in view["devices"]:
        p = rows.setdefault(d["profile"] or "?", {"n": 0, "online": 0, "accepted": 0, "refused": 0, "up": 0,
                                                   "down": 0})
        p["n"] += 1
        p["online"] += d["state"] == "online"
        p["accepted"] += d["accepted"]
        p["refused"] += sum(d["refused"].values())
        p["up"] += d["bytes_up"]
        p["down"] += d["bytes_down"]
    colours = profile_colours(list(rows))
    body = []
    for name, p in sorted(rows.items()):
        s = (last or {}).get("profiles", {}).get(name)
        acc = _pct(s["acc_sum"] / s["acc_n"]) if s and s["acc_n"] else "–"
        body.append(f'<tr data-profile="{_e(name)}"><td><i class="sw" style="background:{colours[name]}"></i>'
                    f'{_e(name)}</td><td class="n">{p["n"]}</td><td class="n">{p["online"]}</td>'
                    f'<td class="n">{p["accepted"]}</td><td class="n">{p["refused"]}</td><td class="n">{acc}</td>'
                    f'<td class="n">{_bytes(p["up"])}</td><td class="n">{_bytes(p["down"])}</td></tr>')
    return ('<table id="profiles"><thead><tr><th>profile</th><th class="n">devices</th><th class="n">online</th>'
            f'<th class="n">accepted</th><th class="n">refused</th><th class="n">acc % (last {view["unit"]})</th>'
            '<th class="n">up</th><th class="n">down</th></tr></thead><tbody>' + "".join(body) + "</tbody></table>")


def _health_cells(d: dict[str, Any], now: float, live: bool) -> str:
    h = d["health"]
    if h is None and not live:
        return '<td class="muted" colspan="5">(heartbeats are not kept in a run directory)</td>'
    if h is None:
        refused = sum(d["health_refused"].values())
        note = f' <span class="why">({refused} refused)</span>' if refused else ""
        return f'<td class="muted" colspan="5">no heartbeat{note}</td>'
    # the agent's RSS, then what is left of the RAM it may use (a container's: its cgroup limit). RSS counts
    # shared library pages and may exceed that limit; the free figure is the one that runs out.
    mem = "–" if h["rss_bytes"] is None else _bytes(h["rss_bytes"])
    if h["mem_available_bytes"] is not None:
        mem += f' / {_bytes(h["mem_available_bytes"])} free'
        if h["mem_total_bytes"] is not None:
            mem += f' of {_bytes(h["mem_total_bytes"])}'
    temp = "–" if h["cpu_temp_c"] is None else f'{h["cpu_temp_c"]:.0f} °C'
    throttle = ", ".join(d["throttle"]) or ("throttled" if h["cpu_mhz"] and h["cpu_max_mhz"]
                                             and h["cpu_mhz"] < 0.8 * h["cpu_max_mhz"] else "")
    cpu = "–" if h["cpu_percent"] is None else f'{h["cpu_percent"]:.0f}'
    disk = "–" if h["disk_free_bytes"] is None else _bytes(h["disk_free_bytes"])
    return (f'<td class="n health-cpu">{cpu}</td><td class="n health-mem">{_e(mem)}</td>'
            f'<td class="n health-temp">{_e(temp)}{" <span class=why>" + _e(throttle) + "</span>" if throttle else ""}'
            f'</td><td class="n">{_e(disk)}</td><td class="muted">{_e(_ago(d["health_at"], now))}</td>')


def device_table(view: dict[str, Any], every_row: bool = False) -> str:
    now = view["generated"]
    devices = sorted(view["devices"], key=lambda d: (STATE_ORDER.get(d["state"], 9), d["device"]))
    note = ""
    if len(devices) > ROWS and not every_row:
        note = (f'<p class="muted" id="rows-note">{ROWS} of {len(devices)} devices, problems first: '
                '<a href="?all=1">show every device</a></p>')
        devices = devices[:ROWS]
    body = []
    for d in devices:
        refused = ", ".join(f"{_e(k)} {v}" for k, v in sorted(d["refused"].items()))
        why = ""
        if d["refusal"]:
            why = f'<div class="why refusal">{_e(d["refusal"]["reason"])}: {_e(d["refusal"]["message"])}</div>'
        err = d["health"]["last_error"] if d["health"] and d["health"]["last_error"] else ""
        state = d["state"]
        body.append(
            f'<tr data-device="{_e(d["device"])}" data-state="{_e(state)}">'
            f'<td>{_e(d["device"])}</td><td>{_e(d["profile"])}</td><td>{_e(d["arch"])}</td>'
            f'<td class="state s-{state.replace(" ", "-")}">{_e(state)}{why}</td>'
            f'<td class="muted">{_e(_ago(d["last_seen"], now) if view["live"] else "–")}</td>'
            f'{_health_cells(d, now, view["live"])}'
            f'<td class="n last-round">{d["last_round"] or "–"}</td>'
            f'<td class="n accepted" data-value="{d["accepted"]}">{d["accepted"]}</td>'
            f'<td class="n missed">{d["missed"]}</td><td class="refused">{refused}</td>'
            f'<td class="n acc" data-value="{"" if d["acc_global"] is None else d["acc_global"]}">'
            f'{_pct(d["acc_global"])}</td><td class="n">{_pct(d["acc_local"])}</td>'
            f'<td class="n up" data-value="{d["bytes_up"]}">{_bytes(d["bytes_up"])}</td>'
            f'<td class="n down" data-value="{d["bytes_down"]}">{_bytes(d["bytes_down"])}</td>'
            f'<td class="err">{_e(err)}</td></tr>')
    return ('<table id="devices"><thead><tr><th>device</th><th>profile</th><th>model</th><th>state</th>'
            '<th>last seen</th><th class="n">CPU %</th>'
            '<th class="n" title="RSS of the agent / free of the RAM it may use">memory</th><th class="n">temp</th>'
            f'<th class="n">disk free</th><th>heartbeat</th><th class="n">last {view["unit"]}</th>'
            '<th class="n">accepted</th>'
            '<th class="n">missed</th><th>refused</th><th class="n">acc %</th><th class="n">local %</th>'
            '<th class="n">up</th><th class="n">down</th><th>last error</th></tr></thead><tbody>'
            + "".join(body) + "</tbody></table>" + note)


def status_line(view: dict[str, Any]) -> str:
    now = view["generated"]
    total = view["total_rounds"]
    cur = view["round"]
    unit = view["unit"]  # "version" in asynchronous mode
    states = {"starting": "starting", "fleet": "waiting for the fleet's hellos", "quorum": "waiting for a quorum",
              "between": f"{unit} {view['completed']}/{total} done", "finished": f"finished: {view['completed']} "
              f"{unit}s", "round": ""}
    if cur is not None:
        left = f", deadline in {max(0.0, cur['deadline'] - now):.0f} s" if cur["deadline"] else ""
        training = ""
        if cur.get("training") is not None:
            k = f", a buffer of {view['buffer_size']}" if view["buffer_size"] else ""
            training = f", {cur['training']} devices training{k}"
        text = (f"{unit} {cur['round']}/{total} ({_e(cur['phase'])}), running for {now - cur['started']:.0f} s"
                f"{left}{training}")
    else:
        text = _e(states.get(view["state"], view["state"]))
    out = [f'<p id="status" data-state="{_e(view["state"])}"><b>{text}</b></p>']
    w = view["waiting"]
    if w:
        items = "".join(f'<li data-device="{_e(x["device"])}"><b>{_e(x["device"])}</b>: '
                        f'<span class="why">{_e(x["why"])}</span></li>' for x in w["devices"][:50])
        more = f"<li>and {len(w['devices']) - 50} more</li>" if len(w["devices"]) > 50 else ""
        out.append(f'<div id="waiting"><p>{_e(w["what"])}:</p><ul>{items}{more}</ul></div>')
    t = view["totals"]
    refused = ", ".join(f"{_e(k)} {v}" for k, v in sorted(t["updates_refused"].items())) or "none"
    h_refused = ", ".join(f"{_e(k)} {v}" for k, v in sorted(t["health_refused"].items())) or "none"
    stale = next((r for r in reversed(view["rounds"]) if r.get("staleness_max") is not None), None)
    staleness = (f'; staleness of the updates in version {stale["round"]}: mean {stale["staleness_mean"]:.1f}, '
                 f'max {stale["staleness_max"]}' if stale is not None else "")
    out.append(f'<p id="totals">{t["updates_accepted"]} updates accepted, refused: {refused}; heartbeats '
               f'{t["health_accepted"]}, refused: {h_refused}; traffic {_bytes(t["bytes_up"])} up, '
               f'{_bytes(t["bytes_down"])} down{staleness}</p>')
    return "".join(out)


def fragment(view: dict[str, Any], every_row: bool = False) -> str:
    """The live part of the page (replaced as a whole by the page's script)."""
    every = REFRESH_MS if len(view["devices"]) <= BIG_FLEET else BIG_REFRESH_MS
    return (f'<div id="live" data-live="{1 if view["live"] else 0}" data-version="{view["version"]}" '
            f'data-refresh="{every}">'
            + status_line(view) + "<h2>Profiles</h2>" + profile_table(view) + charts(view)
            + f'<h2>Devices ({len(view["devices"])})</h2>' + device_table(view, every_row) + "</div>")


def page(view: dict[str, Any], title: str = "", every_row: bool = False) -> str:
    where = title or ("live" if view["live"] else "after the fact")
    head = (f"fedge · {view['fleet'] or 'fleet'} · {view['method']}")
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<meta name=viewport content='width=device-width'><title>{_e(head)}</title>"
            f"<style>{STYLE}</style></head><body>"
            f"<h1>{_e(head)}</h1><p class=muted>run {_e(view['run_id'][:8] or '?')} · {_e(where)} · "
            f"page drawn {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(view['generated']))} "
            "<span id=stale hidden>· the coordinator does not answer</span></p>"
            + fragment(view, every_row) + '<script src="dashboard.js"></script></body></html>')


def routes_for(view: Callable[[], dict[str, Any]], metrics: Callable[[], bytes] | None = None,
               title: str = "") -> Routes:
    """The page, its live fragment, ``/api/state`` and ``/metrics`` of a view function."""
    return Routes(page=lambda every_row: page(view(), title, every_row),
                  fragment=lambda every_row: fragment(view(), every_row), state=view,
                  metrics=metrics, script=SCRIPT)


def monitor_routes(monitor: FleetMonitor, metrics: Callable[[], bytes] | None = None, title: str = "") -> Routes:
    """:func:`routes_for` a live monitor."""
    return routes_for(monitor.view, metrics, title)
