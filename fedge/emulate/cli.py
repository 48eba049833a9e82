"""``fedge emulate``: a fleet config as Docker containers that behave like their profiles."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from fedge.emulate import FAULTS

if TYPE_CHECKING:
    from fedge.emulate.emulation import Emulation
    from fedge.emulate.status import DeviceStatus

DEFAULT_DIR = "runs/emulate"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser("emulate", help="run a fleet as Docker containers limited like their profiles",
                       description="Emulate a fleet in Docker: one container per device with its profile's CPU "
                                   "speed, memory and link, booting from its flashed payload; Mosquitto and the "
                                   "coordinator in containers too. See docs/emulate.md.")
    esub = e.add_subparsers(dest="emulate_command", metavar="ACTION", required=True)

    up = esub.add_parser("up", help="write compose.yaml, flash the devices, build images if missing, start",
                         description="Write DIR/compose.yaml, the broker config and each device's flashed "
                                     "payload, build the images that are missing, start broker, coordinator "
                                     "and devices; a sharded fleet ([[shards]] or --shards N) also gets a broker "
                                     "and a relay container per shard, each device on its shard's broker.")
    up.add_argument("fleet", metavar="FLEET.toml", help="the fleet config")
    up.add_argument("--out", default=DEFAULT_DIR, metavar="DIR", help=f"emulation directory (default {DEFAULT_DIR})")
    up.add_argument("--arch", default="amd64", choices=("amd64", "arm64"),
                    help="device containers' CPU architecture (arm64 runs under QEMU: needs binfmt_misc)")
    up.add_argument("--base-image", metavar="IMAGE",
                    help="base image with Python 3.11 (default: fedge-base:bookworm-ARCH, built with debootstrap)")
    up.add_argument("--loss", type=float, default=0.0, metavar="PCT", help="packet loss on every device link, %%")
    up.add_argument("--min-devices", type=int, metavar="N",
                    help="devices online before a round starts (default: all, so round 1 matches fedge simulate)")
    up.add_argument("--deadline-slack", type=float, default=3.0,
                    help="coordinator round deadline = slack x the slowest device's expected time (default 3)")
    up.add_argument("--subnet", metavar="CIDR",
                    help="the fleet network's private IPv4 subnet (default a /24 in 10.200-249.x.0 picked by the "
                         "emulation directory's hash; set it when that one is taken on this host)")
    up.add_argument("--sign", action="store_true",
                    help="the fleet signs (fedge broker config --sign): devices verify round descriptors and global "
                         "state and accept `fedge deploy` updates (broker/coordinator/signing.key, the broker/deploy "
                         "account) into their model stores")
    up.add_argument("--shards", type=int, metavar="N",
                    help="emulate the fleet sharded: N shard brokers of contiguous devices (fleet order), each with "
                         "its relay (fedge relay) in a container under the root broker, the coordinator's. A fleet "
                         "config's [[shards]] tables do the same with their own devices and tree, without this flag "
                         "(docs/emulate.md, 'Sharded fleets')")
    up.add_argument("--no-start", action="store_true", help="write and build, start nothing")
    up.add_argument("--wait", action="store_true", help="wait for the coordinator to finish, then print status")
    up.add_argument("--timeout", type=float, default=3600.0, help="with --wait: give up after S seconds")
    up.set_defaults(func=_up)

    for name, helptext in (("status", "per device: state, round, CPU, memory, bytes sent"),
                           ("down", "stop and remove the containers (results stay in DIR)")):
        p = esub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("--dir", default=DEFAULT_DIR, help=f"emulation directory (default {DEFAULT_DIR})")
        p.set_defaults(func=_status if name == "status" else _down)

    lg = esub.add_parser("logs", help="a container's log", description="Print a device's, the broker's, the "
                                                                        "coordinator's, a shard broker's or a "
                                                                        "relay's log.")
    lg.add_argument("service", help="device id, broker, coordinator, broker-NAME or relay-NAME (shard NAME)")
    lg.add_argument("--tail", type=int, help="last N lines")
    lg.add_argument("--dir", default=DEFAULT_DIR)
    lg.set_defaults(func=_logs)

    f = esub.add_parser("fault", help="kill, pause, partition or throttle a device; restart broker or coordinator",
                        description="kill DEVICE (SIGKILL; --for S starts it again: a reboot), pause DEVICE "
                                    "(freeze), partition DEVICE (disconnect from the fleet network), throttle DEVICE "
                                    "(its CPU quota x0.6, and it reports itself hot with the Pi firmware's throttling "
                                    "flags), resume DEVICE (undo pause/partition/throttle; start a killed device "
                                    "again), restart broker|coordinator. "
                                    "In a sharded fleet each shard's broker-NAME and relay-NAME take all five. "
                                    "A fault the device's state rules out (killing an exited device) says so.")
    f.add_argument("action", choices=FAULTS)
    f.add_argument("target", help="device id, or broker/coordinator for restart; broker-NAME or relay-NAME (shard "
                                  "NAME) for any")
    f.add_argument("--for", dest="duration", type=float, metavar="S", help="undo the fault after S seconds")
    f.add_argument("--dir", default=DEFAULT_DIR)
    f.set_defaults(func=_fault)


def _up(args: argparse.Namespace) -> int:
    from fedge.emulate import images
    from fedge.emulate.discovery import docker_client
    from fedge.emulate.lifecycle import prepare, start, wait_exited
    from fedge.emulate.status import status

    images.check_arch(args.arch)
    _check_shards(args.fleet, args.shards)  # a layout that does not fit, before minutes of image building
    client = docker_client()
    tags = images.ensure_images(client, args.arch, base=args.base_image)
    emu = prepare(args.fleet, args.out, arch=args.arch, images=tags, loss_pct=args.loss, sign=args.sign,
                  min_devices=args.min_devices, deadline_slack=args.deadline_slack, subnet=args.subnet,
                  shards=args.shards)
    print(f"wrote {emu.out / 'compose.yaml'} ({len(emu.devices)} devices; images {tags.device}, "
          f"{tags.coordinator}, {tags.broker})")
    for s in emu.shards:
        print(f"  shard {s['name']}: {s['broker']} and {s['relay']} (up to {s['up']}), {len(s['devices'])} devices: "
              f"{', '.join(s['devices'])}")
    for dev, lim in emu.limits.items():
        plan = emu.plans[dev]
        slices = (f" ({lim['cpu_quota_us'] / 1000:g} ms per {lim['cpu_period_us'] / 1000:g} ms)"
                  if "cpu_period_us" in lim else "")
        print(f"  {dev:<18} {lim['profile']:<13} cpus {lim['cpus']:g}{slices}  mem {lim['mem_limit_mb']} MiB  "
              f"up {lim['uplink_kbit']} / down {lim['downlink_kbit']} kbit/s  delay {lim['delay_ms']:g} ms each way  "
              f"plan {plan['arch']} batch {plan['batch_size']}, est. {plan['round_time_s']:.1f} s/round")
    if args.no_start:
        return 0
    start(emu, client)
    print(f"started project {emu.project}: fedge emulate status --dir {args.out}")
    if args.sign:
        from fedge.emulate.lifecycle import broker_address

        b = emu.out / "broker"
        print(f"signed fleet: over-the-air updates with fedge deploy --config {emu.out / 'fleet.toml'} --broker "
              f"mqtt://{broker_address(emu, client)}:1883 --username fedge-deploy --password-file "
              f"{b / 'deploy' / 'password'} --signing-key {b / 'coordinator' / 'signing.key'} --model DIR --version N")
    if emu.dashboard:
        print(f"dashboard and /metrics on {emu.dashboard} (loopback; the browser asks for a password: the token in "
              f"{emu.out / 'http' / 'token'}, any user name)")
    if args.wait:
        code = wait_exited(emu, client, "coordinator", args.timeout)
        print(format_status(status(emu, client), emu, client))
        return 0 if code == 0 else 1
    return 0


def _check_shards(fleet: str, count: int | None) -> None:
    """``--shards`` or ``[[shards]]`` that cannot be emulated: refused (ConfigError) before anything is built."""
    from fedge.emulate.shards import emulated_layout
    from fedge.fleet.config import device_ids, load_fleet

    cfg = load_fleet(fleet)
    emulated_layout(cfg, [i for i, _ in device_ids(cfg)], count)


def _status(args: argparse.Namespace) -> int:
    from fedge.emulate.discovery import docker_client
    from fedge.emulate.emulation import Emulation
    from fedge.emulate.status import status

    emu = Emulation.load(args.dir)
    client = docker_client()
    print(format_status(status(emu, client), emu, client))
    return 0


def _down(args: argparse.Namespace) -> int:
    from fedge.emulate.emulation import Emulation
    from fedge.emulate.lifecycle import down

    emu = Emulation.load(args.dir)
    down(emu)
    print(f"removed the containers of {emu.project}; results stay in {emu.out}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    from fedge.emulate.discovery import docker_client
    from fedge.emulate.emulation import Emulation
    from fedge.emulate.status import logs

    emu = Emulation.load(args.dir)
    print(logs(emu, docker_client(), args.service, tail=args.tail), end="")
    return 0


def _fault(args: argparse.Namespace) -> int:
    from fedge.emulate.discovery import docker_client
    from fedge.emulate.emulation import Emulation
    from fedge.emulate.faults import fault

    emu = Emulation.load(args.dir)
    print(fault(emu, docker_client(), args.action, args.target, duration=args.duration))
    return 0


def format_status(rows: list[DeviceStatus], emu: Emulation, client: Any) -> str:
    """The table ``fedge emulate status`` prints, then one line per device that needs words."""
    from fedge.common.units import format_bytes
    from fedge.emulate.compose import BROKER, COORDINATOR
    from fedge.emulate.status import service_state

    lines = [f"broker: {service_state(emu, client, BROKER)}   coordinator: {service_state(emu, client, COORDINATOR)}"]
    for s in emu.shards:  # a sharded fleet: each shard's broker and relay, and the broker the relay reports to
        lines.append(f"shard {s['name']}: {s['broker']}: {service_state(emu, client, s['broker'])}   {s['relay']}: "
                     f"{service_state(emu, client, s['relay'])} (up to {s['up']})   devices: {', '.join(s['devices'])}")
    # sent: update bytes the coordinator accepted from the device (kept after it exits); net tx: what its
    # container sent on the fleet network, MQTT overhead included (only while the container runs).
    head = (f"{'device':<18} {'profile':<13} {'state':<12} {'round':>5} {'cpu':>6} {'mem MiB':>13} {'sent':>10} "
            f"{'net tx':>10}")
    lines += [head, "-" * len(head)]
    for r in rows:
        mem = f"{r.mem_mb:.0f}/{r.mem_limit_mb}" if r.mem_mb is not None else f"-/{r.mem_limit_mb}"
        cpu = f"{r.cpu_pct:.0f}%" if r.cpu_pct is not None else "-"
        tx = format_bytes(r.tx_bytes, binary=False) if r.tx_bytes is not None else "-"
        lines.append(f"{r.device_id:<18} {r.profile:<13} {r.state:<12} {r.round if r.round is not None else '-':>5} "
                     f"{cpu:>6} {mem:>13} {format_bytes(r.sent_bytes, binary=False):>10} {tx:>10}")
    lines += [r.message for r in rows if r.message]
    return "\n".join(lines)
