"""``fedge deploy``: publish a new, signed model version to chosen devices of a fleet, canary stage first.

    fedge deploy --config fleet.toml --model exported/cam-1 --version 4 --devices all --canary 0.25 \\
        --broker mqtts://broker.lan:8883 --ca broker/deploy/ca.crt --cert broker/deploy/client.crt \\
        --key broker/deploy/client.key --signing-key broker/coordinator/signing.key

Exit codes: 0 every chosen device installed it; 10 the rollout stopped (a canary failed, rolled back,
refused it or did not answer) or a device of the second stage did not install it; 2 bad input (nothing is
published).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedge.common.atomicfile import write_atomic
from fedge.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from fedge.mqtt.flags import add_broker_arguments

    d = sub.add_parser(
        "deploy", help="publish a signed model version to devices over the air, canary stage first",
        description="Publish a model version (a `fedge export` directory) to chosen devices: signed with the "
                    "fleet key, chunked, retained (a device resumes an interrupted download). Each device verifies "
                    "it, checks it on its own validation split and with a smoke test, switches it in atomically "
                    "keeping the previous version, and rolls back by itself when a check fails or the model "
                    "crashes repeatedly. A canary fraction of the devices gets it first; the rest only if every "
                    "canary installed it.")
    d.add_argument("--config", required=True, metavar="FLEET.toml", help="the fleet config (fleet name, devices)")
    d.add_argument("--model", required=True, metavar="DIR", help="the model directory (`fedge export` output)")
    d.add_argument("--version", required=True, type=int, help="the model version (an integer above the installed one)")
    d.add_argument("--signing-key", required=True, metavar="FILE",
                   help="the fleet's Ed25519 key (coordinator/signing.key)")
    d.add_argument("--devices", default="all", help="comma-separated device ids, or all (default)")
    d.add_argument("--canary", type=float, default=0.25, metavar="FRACTION",
                   help="fraction of the chosen devices updated first (default 0.25; 0: all at once)")
    d.add_argument("--threshold", type=float, default=0.02,
                   help="largest drop of local accuracy a device accepts (default 0.02: 2 points)")
    d.add_argument("--timeout", type=float, default=600.0, metavar="S", help="how long each stage waits for answers")
    d.add_argument("--chunk-bytes", type=int, default=256 * 1024, help="chunk size (the broker's limit follows it)")
    d.add_argument("--status-file", metavar="FILE.json", help="write every device's status to this file")
    add_broker_arguments(d, required=True)
    d.set_defaults(func=_deploy)


def _devices(spec: str, ids: list[str], source: str) -> list[str]:
    if spec == "all":
        return ids
    chosen = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [c for c in chosen if c not in ids]
    if unknown or not chosen:
        raise ConfigError(f"--devices {spec!r}: {', '.join(unknown) or 'no device'} not in {source}",
                          hint=f"its devices are {', '.join(ids[:8])}{' ...' if len(ids) > 8 else ''}")
    return list(dict.fromkeys(chosen))


def _deploy(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from fedge.common.keyrotation import chain_for_key
    from fedge.common.signing import Signer
    from fedge.deploy.rollout import DeployError, RolloutPlan, StatusBoard, describe, rollout
    from fedge.fleet.config import device_ids, load_fleet
    from fedge.mqtt.client import MqttClient
    from fedge.mqtt.flags import broker_settings
    from fedge.mqtt.topics import FleetTopics
    from fedge.runtime.manifest import read_manifest, verify_files
    from fedge.runtime.package import check_version, pack_dir
    from fedge.runtime.signature import sign_manifest

    cfg = load_fleet(args.config)
    devices = _devices(args.devices, [i for i, _ in device_ids(cfg)], cfg.source)
    if not 0 <= args.canary <= 1 or not 0 <= args.threshold <= 1:
        raise ConfigError("--canary and --threshold are fractions in [0, 1]")
    try:
        check_version(args.version)
    except Exception as exc:
        raise ConfigError(f"--version {args.version}: versions are integers from 1") from exc
    signer = Signer.from_file(args.signing_key)
    chain = chain_for_key(args.signing_key, signer.key)  # the fleet key's rotations: devices must know this key
    model = Path(args.model)
    verify_files(model, read_manifest(model))  # a damaged export fails here, before anything is published
    with tempfile.TemporaryDirectory(prefix="fedge-deploy-") as tmp:
        staged = Path(tmp) / "model"
        shutil.copytree(model, staged)
        sign_manifest(staged, signer)  # the installed model carries the fleet's signature (fedge infer --fleet-key)
        package = pack_dir(staged, cfg.run.fleet, args.version).to_bytes()
    topics = FleetTopics(cfg.run.fleet)
    board = StatusBoard(topics)
    client = MqttClient(broker_settings(args), f"fedge-deploy-{cfg.run.fleet}", on_message=board.on_message)
    client.subscribe(topics.ota_status_filter())
    client.start(30)
    try:
        if chain is not None:  # before any order: a device that still trusts an older key follows it first
            client.require_published([client.publish(topics.fleet_keys, chain.to_bytes(), retain=True)], 30,
                                     "publishing the fleet's key chain")
        import time

        time.sleep(1.0)  # the retained statuses of every device arrive first
        ahead = {d: s.get("version") for d, s in board.latest.items() if d in devices
                 and isinstance(s.get("version"), int) and s["version"] >= args.version}
        if ahead:
            listed = ", ".join(f"{d} runs version {v}" for d, v in sorted(ahead.items()))
            raise ConfigError(f"--version {args.version} is not newer than what {listed}: nothing was published",
                              hint="deploy a higher version (versions only go up; rollbacks are automatic)")
        plan = RolloutPlan(args.version, devices, args.canary, args.threshold, args.timeout, args.chunk_bytes)
        print(f"deploying model version {args.version} ({len(package):,} bytes, key {signer.key_id}) to "
              f"{len(devices)} devices of fleet {cfg.run.fleet}: " +
              " then ".join(f"{len(s)} ({', '.join(s[:4])}{' ...' if len(s) > 4 else ''})" for s in plan.stages()),
              file=sys.stderr)
        report = rollout(client, board, signer, package, plan)
    finally:
        client.stop()
    for stage_no, stage in enumerate(report.stages):
        for d in stage:
            skipped = report.stopped_at_canary and stage_no > 0
            print(f"{d:24s} {'not ordered (the canary stage failed)' if skipped else describe(report.statuses[d])}")
    if args.status_file:
        write_atomic(args.status_file, (json.dumps(report.to_dict(), indent=1) + "\n").encode(), durable=False)
    if report.stopped_at_canary:
        raise DeployError(f"the canary stage failed: version {args.version} went to no other device",
                          hint="see each canary's reason above; fix the model and deploy a new version")
    if not report.ok:
        raise DeployError(f"version {args.version} is not installed on every chosen device")
    print(f"model version {args.version} installed on all {len(devices)} devices")
    return 0
