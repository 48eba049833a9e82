"""The device-sized install: `fedge infer` (the runtime set) never imports torch or the simulation stack, and a
command whose extra is missing names the extra. Missing packages are simulated honestly: a subprocess whose
``sys.meta_path`` refuses to find them, exactly as Python reports a package that is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from export_helpers import digits, trained
from PIL import Image

from fedge.common.extras import EXTRA_OF
from fedge.export.exporter import export_model
from fedge.flash.wheels import device_requirements

REPO = Path(__file__).resolve().parents[1]
# Run fedge's CLI with the named top-level modules unfindable; report which of them anything tried to import.
BLOCKED_RUN = """
import json, sys
blocked, tried = set(sys.argv[1].split(",")), []
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in blocked:
            tried.append(top)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
from fedge.cli import main
try:
    rc = main(sys.argv[2:])
finally:
    print("TRIED " + json.dumps(sorted(set(tried))), file=sys.stderr)
sys.exit(rc)
"""
NOT_RUNTIME = sorted(m for m, (_, extra) in EXTRA_OF.items() if extra != "runtime")


def run_without(modules: list[str], *args: str) -> tuple[int, str, str, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", BLOCKED_RUN, ",".join(modules), *args], capture_output=True,
                          text=True, env=env, timeout=120)
    tried = json.loads(proc.stderr.rsplit("TRIED ", 1)[1])
    return proc.returncode, proc.stdout, proc.stderr, tried


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "m"
    export_model(trained(), out, quant="fp32", test=digits()[1])
    return out


def digit_png(path: Path) -> Path:
    from sklearn.datasets import load_digits

    d = load_digits()
    Image.fromarray((d.images[7] * (255 / 16)).round().astype(np.uint8), mode="L").save(path)
    return path


def test_infer_runs_on_the_runtime_set_without_touching_torch(exported: Path, tmp_path: Path) -> None:
    png = digit_png(tmp_path / "seven.png")
    rc, out, err, tried = run_without(NOT_RUNTIME, "infer", "--model", str(exported), str(png), "--json")
    assert rc == 0, err
    assert tried == []  # not even an attempt: torch, onnx, sklearn, matplotlib, amqtt ... are never imported
    rows = json.loads(out)
    assert [r["input"] for r in rows] == [str(png)]
    assert rows[0]["top"][0]["class"] == "7"  # the trained model reads the digit


def test_infer_without_a_fleet_key_never_imports_cryptography(exported: Path, tmp_path: Path) -> None:
    # Verifying a signed manifest needs `cryptography`; an unsigned model's inference does not load it (its
    # import added 10 MB to `fedge infer`'s peak RSS on the runtime set when the runtime imported it eagerly).
    png = digit_png(tmp_path / "seven.png")
    rc, out, err, tried = run_without(["cryptography"], "infer", "--model", str(exported), str(png), "--json")
    assert rc == 0, err
    assert tried == []
    assert json.loads(out)[0]["top"][0]["class"] == "7"


@pytest.mark.parametrize(("blocked", "args", "extra"), [
    (["onnxruntime"], ["infer", "--model", "{model}", "{png}"], "runtime"),
    (["PIL"], ["infer", "--model", "{model}", "{png}"], "runtime"),
    (["torch"], ["edge", "run", "--config", "{fleet}", "--device-id", "rpi4-2gb-1", "--broker",
                 "mqtt://127.0.0.1:9", "--data", "{data}"], "device"),
    (["tqdm", "torchvision", "matplotlib", "sklearn", "amqtt"], ["simulate", "{fleet}", "--out", "{out}"], "sim"),
])
def test_a_missing_extra_is_named(exported: Path, tmp_path: Path, blocked: list[str], args: list[str],
                                  extra: str) -> None:
    from own_data_helpers import own_data_fleet, write_digit_pngs

    fleet = own_data_fleet(tmp_path / "fleet.toml")
    write_digit_pngs(tmp_path / "data", 2)
    values = {"model": str(exported), "png": str(digit_png(tmp_path / "d.png")), "fleet": str(fleet),
              "data": str(tmp_path / "data"), "out": str(tmp_path / "run")}
    rc, _, err, tried = run_without(blocked, *[a.format(**values) for a in args])
    assert tried, err  # the command did need the package
    assert rc == 8, err
    assert f"pip install 'fedge[{extra}]'" in err and "Traceback" not in err


def test_extras_in_pyproject_hold_what_the_helper_names() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {r.split(">")[0].split("<")[0] for r in project["dependencies"]}
    assert core == {"numpy", "safetensors", "paho-mqtt", "cryptography"}
    assert not any(r.startswith("torch") and "<" in r for rs in project["optional-dependencies"].values() for r in rs)
    for module, (dist, extra) in EXTRA_OF.items():
        reqs = {r.split(">")[0].split("<")[0].split("=")[0] for r in device_requirements(extra)}
        assert dist in reqs, (module, extra)
    device = {r.split(">")[0] for r in device_requirements("device")}
    assert device == {"numpy", "safetensors", "paho-mqtt", "cryptography", "onnxruntime", "pillow", "torch"}
    runtime = {r.split(">")[0] for r in device_requirements("runtime")}
    assert runtime == {"numpy", "safetensors", "paho-mqtt", "cryptography", "onnxruntime", "pillow"}


def test_flash_runs_on_the_core_install(tmp_path: Path) -> None:
    """A workstation needs no extra to flash a Raspberry Pi OS card (yaml only for cloud-init images)."""
    from test_flash import fleet_and_broker, rpi_boot

    fleet, broker = fleet_and_broker(tmp_path)
    boot = rpi_boot(tmp_path / "boot")
    rc, out, err, tried = run_without(sorted(EXTRA_OF), "flash", "rpi4-2gb-1", "--fleet", str(fleet),
                                      "--broker-dir", str(broker), "--to", str(boot))
    assert (rc, tried) == (0, []), err
    assert (boot / "fedge" / "payload.json").is_file() and "fedge/install.sh" in out


def test_a_flashed_model_is_installed_and_classifies_on_the_runtime_set(exported: Path, tmp_path: Path) -> None:
    """--export: a real exported model travels in the payload, install.sh puts it under opt/fedge/model, and
    `fedge infer` on the runtime set (torch and the rest unfindable) classifies a digit with it."""
    from test_flash import fleet_and_broker, install, rpi_boot

    from fedge.flash.flash import flash_dir
    from fedge.flash.payload import prepare

    fleet, broker = fleet_and_broker(tmp_path)
    boot = rpi_boot(tmp_path / "boot")
    flash_dir(boot, prepare("rpi4-2gb-1", fleet, broker, export_dir=exported))
    meta = json.loads((boot / "fedge" / "payload.json").read_text())
    shipped = sorted(rel[len("model/"):] for rel in meta["files"] if rel.startswith("model/"))
    assert shipped == sorted(str(p.relative_to(exported)) for p in exported.rglob("*") if p.is_file())
    prefix = tmp_path / "root"
    done = install(boot, prefix, "--no-systemd")
    assert done.returncode == 0, done.stderr
    model = prefix / "opt" / "fedge" / "model"
    assert (model / "manifest.json").read_bytes() == (exported / "manifest.json").read_bytes()
    png = digit_png(tmp_path / "seven.png")
    rc, out, err, tried = run_without(NOT_RUNTIME, "infer", "--model", str(model), str(png), "--json")
    assert (rc, tried) == (0, []), err
    assert json.loads(out)[0]["top"][0]["class"] == "7"
