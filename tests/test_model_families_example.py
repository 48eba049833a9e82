"""examples/my_family.py end to end: a fleet trains the user's own family over MQTT, one device's model is
exported and verified, and `fedge infer` (the torch-free runtime) classifies a 640x480 frame with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedge.common.preprocess import Normalization, preprocess
from fedge.common.tomlconf import read_toml
from fedge.edge.models import FamilyNet, load_checkpoint
from fedge.export.exporter import ExportOptions
from fedge.export.fleet import export_checkpoint
from fedge.fleet.config import parse_fleet
from fedge.sim.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "my-family.toml"


@pytest.mark.slow
def test_the_example_family_trains_over_mqtt_exports_and_infers_on_a_frame_of_another_size(
        tmp_path: Path, embedded_broker: None) -> None:
    data = read_toml(EXAMPLE)
    data["run"]["rounds"] = 2
    data["devices"] = [{"profile": "rpi-zero-2w", "count": 1}, {"profile": "x86-gateway", "count": 1}]
    cfg = parse_fleet(data, source=str(EXAMPLE))  # the family's path is relative to the example's directory
    result = simulate(cfg, transport="mqtt", out_dir=tmp_path / "run")
    assert [r.phase for r in result.reports].count("train") == 2
    archs = [d.info.arch for d in result.devices]
    assert archs[0].startswith("my_family-") and all(a.endswith("-48") for a in archs)
    ckpt = tmp_path / "run" / "checkpoints" / "x86-gateway-1.safetensors"
    net = load_checkpoint(ckpt, expect=FamilyNet)
    assert net.spec.input_shape == (1, 48, 48) and net.spec.name == archs[1]
    assert result.devices[1].info.extra["params"] == sum(p.numel() for p in net.parameters())

    out = tmp_path / "export"
    manifest = export_checkpoint(ckpt, out, quant="fp32", profile="x86-gateway", dataset="digits",
                                 test_samples=200, options=ExportOptions(latency_runs=5))
    assert tuple(manifest.input_shape) == ("batch", 1, 48, 48)
    assert manifest.normalization["size"] == 48

    # a 640x480 camera frame: the runtime resizes it to 48x48 exactly as training prepared the digits
    rng = np.random.default_rng(0)
    frame = (rng.random((480, 640)) * 255).astype(np.uint8)
    frame[100:380, 200:440] = 255
    Image.fromarray(frame).save(tmp_path / "frame.png")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = ("import runpy, sys; sys.argv = ['fedge', 'infer', '--model', sys.argv[1], '--json', '--top', '3', "
            "sys.argv[2]]; runpy.run_module('fedge', run_name='__main__')")
    probe = "import sys; sys.modules['torch'] = None; " + code  # the runtime must not need torch
    proc = subprocess.run([sys.executable, "-c", probe, str(out), str(tmp_path / "frame.png")], env=env,
                          capture_output=True, text=True, check=True)
    rows = json.loads(proc.stdout)
    top = rows[0]["top"]
    norm = Normalization(**{k: manifest.normalization[k] for k in ("mean", "std", "size", "channels")})
    x = preprocess(frame, norm)
    assert x.shape == (1, 1, 48, 48)
    with torch.no_grad():
        probs = torch.softmax(net.eval()(torch.from_numpy(x)), dim=1)[0].numpy()
    assert top[0]["index"] == int(probs.argmax())
    assert top[0]["prob"] == pytest.approx(float(probs.max()), abs=1e-4)
