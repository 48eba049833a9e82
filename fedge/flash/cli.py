"""``fedge flash``: put one device of a fleet on its boot medium, a disk image, or a running board."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from fedge.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    f = sub.add_parser(
        "flash", help="write what a device needs to join its fleet at first boot",
        description="Write one device's payload (its bundle: id, broker URL, its own credentials, CA; the "
                    "exported model with --export; an offline wheelhouse with --wheels; install.sh and the "
                    "fedge-edge systemd unit) and a first-boot hook (Raspberry Pi OS firstrun.sh or cloud-init "
                    "user-data) to a mounted boot partition, into a disk image, or install it over SSH. "
                    "See docs/flash.md.")
    f.add_argument("device_id", metavar="DEVICE_ID", help="the device's id in the fleet config (e.g. rpi4-2gb-1)")
    f.add_argument("--fleet", required=True, metavar="FLEET.toml", help="the fleet config")
    f.add_argument("--broker-dir", required=True, metavar="DIR",
                   help="the output of `fedge broker config` (the device's bundle is DIR/bundles/DEVICE_ID)")
    f.add_argument("--export", metavar="DIR", help="exported models (`fedge export`): DIR/DEVICE_ID or one model dir")
    f.add_argument("--wheels", action="store_true",
                   help="add an offline wheelhouse of fedge[device] (fedge[sim] for a fleet without [data] "
                        "classes) for the device's CPU (from its profile) and Python")
    f.add_argument("--wheel-index", action="append", default=[], metavar="URL",
                   help="--wheels: an extra package index, e.g. https://download.pytorch.org/whl/cpu (PyPI's torch "
                        "for aarch64 pulls CUDA packages; the CPU-only build does not)")
    f.add_argument("--python", metavar="X.Y", help="the device's Python for --wheels (default 3.11: RPi OS bookworm)")
    where = f.add_mutually_exclusive_group(required=True)
    where.add_argument("--to", metavar="BOOT_DIR", help="a mounted boot partition (has cmdline.txt or config.txt)")
    where.add_argument("--image", metavar="IMAGE.img", help="a disk image: its FAT boot partition is edited in place")
    where.add_argument("--ssh", metavar="USER@HOST", help="copy the payload to a running device and run install.sh")
    f.add_argument("--init", choices=("auto", "firstrun", "cloud-init", "none"), default="auto",
                   help="first-boot hook (default: detected from the boot partition)")
    f.add_argument("--force", action="store_true", help="--to: write into a directory that is not a boot partition")
    f.add_argument("--dry-run", action="store_true", help="list every file and its size; write nothing")
    f.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                   help="--ssh: an ssh -o option, e.g. Port=2222 or IdentityFile=~/.ssh/fleet (repeatable)")
    f.add_argument("--remote-dir", default="/tmp/fedge-flash", help="--ssh: where the payload is copied")
    f.add_argument("--install-args", default="", metavar="ARGS",
                   help="--ssh: arguments for install.sh, e.g. '--prefix /srv/fedge --no-systemd'")
    f.set_defaults(func=_flash)


def _flash(args: argparse.Namespace) -> int:
    import shlex

    from fedge.flash.payload import Source, prepare

    plan = prepare(args.device_id, args.fleet, args.broker_dir, export_dir=args.export, python=args.python)
    init = None if args.init == "auto" else args.init
    if not plan.own_data:
        print(f"note: {args.fleet} has no [data] classes: {plan.device_id} will train on its share of the "
              "benchmark data set, rebuilt on the device, and installs fedge[sim] for it; add [data] classes to "
              "train on the device's own images (fedge[device])", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="fedge-wheels-") as tmp:
        wheels: list[Source] = []
        if args.wheels and args.dry_run:
            from fedge.flash.wheels import device_requirements, download_command

            cmd = download_command(plan.cpu_arch, plan.python, Path("WHEELS"),
                                   device_requirements(plan.install_extra), tuple(args.wheel_index))
            print(f"--wheels (not downloaded in a dry run): {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr)
        elif args.wheels:
            from fedge.flash.wheels import build_wheelhouse

            wheels = build_wheelhouse(plan.cpu_arch, plan.python, Path(tmp), tuple(args.wheel_index),
                                      plan.install_extra)
        if args.to:
            from fedge.flash.flash import flash_dir

            listing = flash_dir(Path(args.to), plan, init=init, force=args.force, dry_run=args.dry_run, wheels=wheels)
            where = args.to
        elif args.image:
            from fedge.flash.image import flash_image

            listing = flash_image(Path(args.image), plan, init=init, dry_run=args.dry_run, wheels=wheels)
            where = args.image
        else:
            from fedge.flash.remote import flash_ssh

            if init not in (None, "none"):
                raise ConfigError("--init does not apply to --ssh: the device is running, install.sh runs now")
            listing = flash_ssh(args.ssh, plan, options=args.ssh_option, remote_dir=args.remote_dir,
                                install_args=shlex.split(args.install_args), dry_run=args.dry_run, wheels=wheels)
            where = args.ssh
    for path, size, mode in listing.files:
        print(f"{mode:04o} {size:>10}  {path}")
    verb = "would write" if args.dry_run else ("installed" if args.ssh else "wrote")
    hook = "" if args.ssh else f", first-boot hook: {listing.init}"
    print(f"{plan.device_id} ({plan.profile}, {plan.cpu_arch}, fleet {plan.fleet}): {verb} {len(listing.files)} "
          f"files, {listing.total_bytes} bytes to {where}{hook}", file=sys.stderr)
    return 0
