"""ONNX export: graphs, parity with PyTorch, quantization levels, manifest, atomic writes, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_helpers import ARCH, digits, leftovers, trained

from fedge.edge.models.checkpoint import save_checkpoint
from fedge.errors import ExportError, ProfileError
from fedge.export.exporter import ExportOptions, export_model
from fedge.export.fleet import export_checkpoint, export_run
from fedge.export.onnx_export import check_onnx, export_graphs, torch_to_onnx
from fedge.export.quantize import calibration_inputs
from fedge.export.verify import run_onnx
from fedge.runtime import EdgeModel, read_manifest
from fedge.runtime.manifest import sha256_file
from fedge.runtime.model import open_session

FAST = ExportOptions(latency_runs=5)
TIMED = ExportOptions(latency_runs=60)  # where the export's own int8-vs-fp32 timing decides what ships


@pytest.fixture(scope="module")
def static_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    train, test = digits()
    out = tmp_path_factory.mktemp("exp") / "int8"
    export_model(trained(), out, quant="int8-static", test=test, calibration=train.x,
                 calibration_label="digits train", profile="unit", plan={"inference_quant": "int8-static"},
                 options=FAST)
    return out


def test_graphs_have_named_io_dynamic_batch_and_opset(tmp_path: Path) -> None:
    paths = export_graphs(trained(), tmp_path)
    expect = {"model": ("image", [1, 32, 32], "logits", [10]), "extractor": ("image", [1, 32, 32], "embedding", [64]),
              "head": ("embedding", [64], "logits", [10])}
    for name, (iname, ishape, oname, oshape) in expect.items():
        m = onnx.load(str(paths[name]))
        assert max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) >= 17
        (inp,), (out,) = m.graph.input, m.graph.output
        assert inp.name == iname and out.name == oname
        dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
        assert dims == ["batch", *ishape]
        assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["batch", *oshape]


def test_fp32_matches_pytorch_within_1e4_at_batch_1_and_batched(tmp_path: Path) -> None:
    net = trained()
    paths = export_graphs(net, tmp_path)
    x = digits()[1].x[:37]
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
        emb = net.features(torch.from_numpy(x)).numpy()
    sess = open_session(paths["model"])
    assert np.abs(run_onnx(sess, x) - ref).max() <= 1e-4
    assert np.abs(run_onnx(sess, x[:1]) - ref[:1]).max() <= 1e-4
    chained = run_onnx(open_session(paths["head"]), run_onnx(open_session(paths["extractor"]), x))
    assert np.abs(run_onnx(open_session(paths["extractor"]), x) - emb).max() <= 1e-4
    assert np.abs(chained - ref).max() <= 1e-4


def test_dynamo_exporter_gives_the_same_graph_contract(tmp_path: Path) -> None:
    net = trained()
    path = torch_to_onnx(net, torch.zeros(2, 1, 32, 32), tmp_path / "m.onnx", input_name="image",
                         output_name="logits", exporter="dynamo")
    x = digits()[1].x[:5]
    sess = open_session(path)
    assert [i.name for i in sess.get_inputs()] == ["image"]
    with torch.no_grad():
        assert np.abs(run_onnx(sess, x) - net(torch.from_numpy(x)).numpy()).max() <= 1e-4


def test_static_export_manifest_records_everything(static_export: Path) -> None:
    m = read_manifest(static_export)
    data = json.loads((static_export / "manifest.json").read_text())
    assert sorted(p.name for p in static_export.iterdir()) == ["extractor.onnx", "head.onnx", "manifest.json",
                                                               "model.onnx"]
    for name, entry in m.files.items():
        assert entry.sha256 == sha256_file(static_export / name)
        assert entry.bytes == (static_export / name).stat().st_size
    assert (m.arch, m.quant, m.opset, m.profile) == (ARCH, "int8-static", 17, "unit")
    assert m.input_shape == ("batch", 1, 32, 32)
    assert m.normalization == {"dataset": "digits", "mean": 0.307, "std": 0.381, "size": 32, "channels": 1}
    assert m.classes == tuple(str(i) for i in range(10))
    assert m.plan == {"inference_quant": "int8-static"}
    acc = m.metrics["accuracy"]
    assert acc["fp32"] > 0.85 and acc["fp32"] - acc["int8-static"] <= 0.01
    assert m.metrics["fp32_agreement_with_pytorch"] >= 0.99
    assert max(v for k, v in m.metrics["fp32_max_abs_diff"].items() if k in ("model", "extractor", "head")) <= 1e-4
    assert set(m.metrics["latency_ms"]) == {"fp32", "int8-static"}
    assert data["calibration"]["source"] == "digits train" and data["calibration"]["samples"] == 256
    assert data["calibration"]["per_channel"] is True and data["calibration"]["format"] == "QDQ"
    # QDQ with per-channel weights: int8 weights, scales along the output channels.
    g = onnx.load(str(static_export / "model.onnx")).graph
    assert {n.op_type for n in g.node} >= {"QuantizeLinear", "DequantizeLinear", "Conv", "Gemm"}
    assert any(t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 4 for t in g.initializer)
    assert m.files["model.onnx"].bytes < 0.5 * m.metrics["fp32_bytes"]["model.onnx"]


@pytest.mark.parametrize("quant", ["fp32", "fp16", "int8-dynamic"])
def test_other_levels_export_and_run(tmp_path: Path, quant: str) -> None:
    _, test = digits()
    m = export_model(trained(), tmp_path / quant, quant=quant, test=test, options=FAST)
    ops = {n.op_type for n in onnx.load(str(tmp_path / quant / "model.onnx")).graph.node}
    assert {"fp32": "Conv", "fp16": "Cast", "int8-dynamic": "ConvInteger"}[quant] in ops
    acc = m.metrics["accuracy"]
    assert acc["fp32"] - acc[quant] <= 0.01
    pred = EdgeModel.load(tmp_path / quant).predict(test.x[:50], preprocessed=True)
    assert (pred.labels == test.y[:50]).mean() > 0.8
    if quant == "int8-dynamic":  # activation scales come from the whole batch: measured and recorded
        dep = m.metrics["batch_dependence"]
        sess = open_session(tmp_path / quant / "model.onnx")
        single, batched = run_onnx(sess, test.x, batch_size=1), run_onnx(sess, test.x, batch_size=256)
        assert dep == {"images": 450, "batch": 256, "predictions_changed": int((single.argmax(1) != batched.argmax(1))
                                                                                .sum()),
                       "max_abs_logit_diff": float(np.abs(single - batched).max())}
        assert dep["max_abs_logit_diff"] > 0  # it does depend on the batch
    else:
        assert "batch_dependence" not in m.metrics


def test_accuracy_drift_fails_and_leaves_nothing(tmp_path: Path) -> None:
    train, test = digits()
    out = tmp_path / "out"
    with pytest.raises(ExportError) as err:
        export_model(trained(), out, quant="int8-static", test=test, calibration=train.x,
                     options=ExportOptions(latency_runs=5, max_accuracy_drop=-0.5))
    msg = str(err.value)
    assert "int8-static accuracy drifted" in msg and "model.onnx" in msg and "vs fp32" in msg
    assert "calibrate on more" in msg and "int8-dynamic" in msg
    assert leftovers(out) == []


def test_fp32_drift_beyond_tolerance_is_named(tmp_path: Path) -> None:
    _, test = digits()
    with pytest.raises(ExportError, match=r"fp32 ONNX drifted from PyTorch: max \|ORT − PyTorch\| = .* > 0 on"):
        export_model(trained(), tmp_path / "o", quant="fp32", test=test,
                     options=ExportOptions(latency_runs=5, fp32_tolerance=0.0))
    assert leftovers(tmp_path / "o") == []


def test_existing_output_is_kept_unless_forced(tmp_path: Path, static_export: Path) -> None:
    _, test = digits()
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists and is not empty"):
        export_model(trained(), out, quant="fp32", test=test, options=FAST)
    assert (out / "keep.txt").read_text() == "mine"
    export_model(trained(), out, quant="fp32", test=test, options=FAST, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["extractor.onnx", "head.onnx", "manifest.json", "model.onnx"]
    assert [p.name for p in tmp_path.iterdir()] == ["o"]


def test_calibration_sources_array_callable_iterable_tensor() -> None:
    x = digits()[0].x
    shape = (1, 32, 32)
    a = calibration_inputs(x, 100, shape)
    assert a.shape == (100, 1, 32, 32) and np.array_equal(a, calibration_inputs(x, 100, shape))
    calls: list[int] = []

    def sampler(n: int) -> torch.Tensor:  # a generator's sampler returns a tensor
        calls.append(n)
        return torch.zeros(n, 1, 32, 32)

    assert calibration_inputs(sampler, 40, shape).shape == (40, 1, 32, 32) and calls == [40]
    batches = (x[i : i + 16] for i in range(0, 64, 16))
    assert np.array_equal(calibration_inputs(batches, 40, shape), x[:40])
    assert calibration_inputs(torch.from_numpy(x[:8]), 100, shape).shape == (8, 1, 32, 32)
    with pytest.raises(ExportError, match=r"calibration inputs have shape \(5, 1, 28, 28\).*\(N, 1, 32, 32\)"):
        calibration_inputs(np.zeros((5, 1, 28, 28), np.float32), 10, shape)
    with pytest.raises(ExportError, match="NaN"):
        calibration_inputs(np.full((5, 1, 32, 32), np.nan, np.float32), 10, shape)


def test_generator_calibration_is_recorded(tmp_path: Path) -> None:
    _, test = digits()
    rng = np.random.default_rng(0)
    m = export_model(trained(), tmp_path / "g", quant="int8-static", test=test,
                     calibration=lambda n: test.x[rng.choice(len(test), n)], calibration_label="generator samples",
                     options=ExportOptions(latency_runs=5, calibration_samples=64))
    assert m.extra["calibration"]["source"] == "generator samples" and m.extra["calibration"]["samples"] == 64


def test_check_onnx_names_truncated_file(tmp_path: Path) -> None:
    path = export_graphs(trained(), tmp_path)["model"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match=r"model\.onnx is not a readable ONNX file \(corrupt or truncated\?\)"):
        check_onnx(path)


# -- checkpoints, profiles and runs ------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "dev.safetensors"
    save_checkpoint(trained(), path, extra={"fedge.dataset": "digits"})
    return path


def _any_profile() -> str:
    from fedge.profiles import list_profiles

    return list_profiles()[0]


def test_checkpoint_export_with_profile(tmp_path: Path, checkpoint: Path) -> None:
    profile = _any_profile()
    m = export_checkpoint(checkpoint, tmp_path / "o", profile=profile, arch=ARCH, quant="int8-static",
                          test_samples=200, options=FAST)
    assert m.profile == profile and m.plan is not None and "inference_quant" in m.plan
    assert m.quant == "int8-static" and m.metrics["test_set"] == {"dataset": "digits", "images": 200}
    assert m.extra["calibration"]["source"].startswith("digits training split")


def test_checkpoint_of_another_architecture(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(ExportError, match=r"holds architecture 'tier-xs', but --arch asks for 'tier-m'") as err:
        export_checkpoint(checkpoint, tmp_path / "o", profile=_any_profile(), arch="tier-m", options=FAST)
    assert "--arch tier-xs" in (err.value.hint or "")
    assert leftovers(tmp_path / "o") == []


def test_checkpoint_architecture_comes_from_the_checkpoint(tmp_path: Path, checkpoint: Path) -> None:
    # x86-gateway plans tier-xl for a standalone device; a fleet's `archs` gave this one tier-xs.
    from fedge.profiles import load_profile, plan

    assert plan(load_profile("x86-gateway")).arch != ARCH
    m = export_checkpoint(checkpoint, tmp_path / "o", profile="x86-gateway", quant="fp32", test_samples=100,
                          options=FAST)
    assert m.arch == ARCH and m.plan is not None and m.plan["arch"] == plan(load_profile("x86-gateway")).arch
    assert EdgeModel.load(tmp_path / "o").manifest.arch == ARCH


def test_int8_measured_slower_on_the_model_ships_fp32(tmp_path: Path, checkpoint: Path) -> None:
    # x86-gateway (VNNI) plans int8-static for its tier-xl; this checkpoint is tier-xs, where the
    # quantize/dequantize overhead makes int8 ~2x slower than fp32 on x86: the export measures it.
    m = export_checkpoint(checkpoint, tmp_path / "o", profile="x86-gateway", test_samples=200, options=TIMED)
    lat, decision = m.metrics["latency_ms"], m.extra["quantization"]
    assert decision["requested"] == "int8-static"
    assert decision["source"].startswith("plan of profile 'x86-gateway', made for tier-xl (this model is tier-xs)")
    how = (f"{lat['int8-static']:.3f} ms vs {lat['fp32']:.3f} ms at fp32 (batch 1, 1 thread, median of 60 interleaved "
           f"runs on {m.metrics['latency']['cpu']}, {m.metrics['latency']['provider']})")
    if lat["int8-static"] < lat["fp32"]:  # not on the x86 machines this was written on (int8 ~2x slower)
        assert m.quant == decision["shipped"] == "int8-static"
        assert decision["reason"] == (f"int8-static (from {decision['source']}) was measured faster than fp32 on "
                                      f"this model: {how}")
        pytest.skip(f"this host measures tier-xs int8 faster than fp32 ({lat}): the fp32 fallback is not exercised "
                    "here (test_profile_measured_table_decides_for_the_models_own_tier covers it from a profile)")
    assert m.quant == "fp32" and decision["shipped"] == "fp32"
    assert decision["reason"] == (
        f"int8-static (from {decision['source']}) was measured slower than fp32 on this model: {how}; shipping fp32")
    assert m.extra["calibration"] is None and decision["calibration"]["samples"] == 256
    assert "Conv" in {n.op_type for n in onnx.load(str(tmp_path / "o" / "model.onnx")).graph.node}
    assert "QuantizeLinear" not in {n.op_type for n in onnx.load(str(tmp_path / "o" / "model.onnx")).graph.node}
    assert set(m.metrics["accuracy"]) == {"fp32", "int8-static"}  # the candidate's figures are kept
    # --quant is an explicit choice: shipped as asked, and the manifest says it was measured slower.
    forced = export_checkpoint(checkpoint, tmp_path / "f", profile="x86-gateway", quant="int8-static",
                               test_samples=200, options=TIMED)
    assert forced.quant == "int8-static" and forced.extra["quantization"]["source"] == "--quant"
    if forced.metrics["latency_ms"]["int8-static"] >= forced.metrics["latency_ms"]["fp32"]:
        assert "shipped as requested although this host measured" in forced.extra["quantization"]["reason"]


def test_profile_measured_table_decides_for_the_models_own_tier(tmp_path: Path, checkpoint: Path) -> None:
    from fedge.export.probe import ProbeResult, detect_hardware, measured_profile
    from fedge.profiles import dump_profile, load_profile, plan

    # Measured on the device: int8 pays on tier-xl (what the plan picks), not on tier-xs.
    lat = {f"tier-{t}/fp32": 1.0 for t in ("xs", "s", "m", "l", "xl")}
    lat |= {f"tier-{t}/int8-static": (0.5 if t in ("l", "xl") else 1.6) for t in ("xs", "s", "m", "l", "xl")}
    result = ProbeResult(lat, {"tier-xl": {"fp32": 0.9, "int8-static": 0.899}}, "digits", 450, 5, 1,
                         detect_hardware())
    path = tmp_path / "measured.toml"
    path.write_text(dump_profile(measured_profile(result, base="x86-gateway", name="gw-measured")))
    assert plan(load_profile(path)).inference_quant == "int8-static"
    m = export_checkpoint(checkpoint, tmp_path / "o", profile=str(path), test_samples=100, options=FAST)
    decision = m.extra["quantization"]
    assert m.quant == "fp32" and decision["requested"] == "fp32" and "int8-static" not in m.metrics["accuracy"]
    assert decision["source"] == ("profile 'gw-measured''s measured table for tier-xs: fastest measured level of "
                                  "tier-xs within 1 accuracy point: 1 ms (int8-static not measured faster than "
                                  "fp32); meets the 5 ms budget")


def test_fp16_plan_ships_fp16_and_says_what_the_host_measured(tmp_path: Path, checkpoint: Path) -> None:
    # jetson-nano plans fp16 for its CUDA GPU; the export host times it on its own provider.
    m = export_checkpoint(checkpoint, tmp_path / "o", profile="jetson-nano", test_samples=100, options=FAST)
    decision, provider = m.extra["quantization"], m.metrics["latency"]["provider"]
    assert m.quant == "fp16" and decision["shipped"] == "fp16"
    assert decision["reason"].startswith("fp16 from plan of profile 'jetson-nano', made for tier-xl")
    if provider == "CPUExecutionProvider":
        assert decision["reason"].endswith("CPUExecutionProvider runs fp16 through casts, so this host's figure "
                                           "says nothing about a device whose provider runs fp16 natively")


def test_unknown_profile(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(ProfileError, match="no-such-device"):
        export_checkpoint(checkpoint, tmp_path / "o", profile="no-such-device", options=FAST)
    assert leftovers(tmp_path / "o") == []


def test_a_generator_checkpoint_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Read from the checkpoint's metadata before anything is built (it used to fail with
    # "unknown builder 'CVAE'"); a run saves its generators under checkpoints/generators/.
    from safetensors.numpy import save_file

    from fedge.cli import main
    from fedge.common.generators import GeneratorSpec
    from fedge.edge.generators.modules import build_generator

    gen = tmp_path / "checkpoints" / "generators" / "cvae.safetensors"
    save_checkpoint(build_generator(GeneratorSpec("cvae", (1, 32, 32), tier="tiny"), seed=0), gen,
                    extra={"fedge.dataset": "digits"})
    with pytest.raises(ExportError) as err:
        export_checkpoint(gen, tmp_path / "o", profile=_any_profile(), options=FAST)
    assert err.value.message == (f"{gen} is a generator checkpoint (CVAE), not a classifier: fedge export exports "
                                 "a device's classifier (FedgeNet)")
    assert "RUN/checkpoints/<device id>.safetensors" in (err.value.hint or "")
    assert main(["export", "--checkpoint", str(gen), "--out", str(tmp_path / "o")]) == ExportError.exit_code
    assert "is a generator checkpoint (CVAE), not a classifier" in capsys.readouterr().err
    foreign = tmp_path / "foreign.safetensors"  # safetensors, but not written by fedge
    save_file({"w": np.zeros(3, np.float32)}, str(foreign))
    with pytest.raises(ExportError, match=r"records no fedge\.builder: not a checkpoint written by fedge"):
        export_checkpoint(foreign, tmp_path / "o", profile=_any_profile(), options=FAST)
    assert leftovers(tmp_path / "o") == []


def test_export_cli(tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli import main

    out = tmp_path / "o"
    args = ["export", "--checkpoint", str(checkpoint), "--profile", _any_profile(), "--quant", "fp32",
            "--test-samples", "100", "--out", str(out)]
    assert main([*args, "--arch", ARCH]) == 0
    printed = capsys.readouterr().out
    assert f"{out}: {ARCH} as fp32 for profile {_any_profile()}" in printed and "on 100 test images" in printed
    assert main([*args, "--arch", ARCH]) == ExportError.exit_code  # exists: needs --force
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main([*args, "--arch", "tier-m", "--force"]) == ExportError.exit_code
    assert "holds architecture 'tier-xs'" in capsys.readouterr().err
    assert read_manifest(out).arch == ARCH  # the failed --force export left the old one in place
    args[4] = "no-such-device"
    assert main(args) == ProfileError.exit_code
    assert "no-such-device" in capsys.readouterr().err


def _fake_run(root: Path, devices: list[tuple[str, str, str]]) -> Path:
    """A run directory in the simulator's layout: results.json + checkpoints/<id>.safetensors."""
    (root / "checkpoints").mkdir(parents=True)
    for dev_id, arch, _quant in devices:
        save_checkpoint(trained(arch), root / "checkpoints" / f"{dev_id}.safetensors",
                        extra={"fedge.dataset": "digits"})
    results = {"dataset": "digits", "config": str(root / "missing-fleet.toml"),
               "devices": [{"id": d, "profile": "unit", "arch": a, "plan": {"inference_quant": q}, "extra": 1}
                           for d, a, q in devices]}
    (root / "results.json").write_text(json.dumps(results))
    return root


def test_run_export_every_device(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run", [("a-1", ARCH, "fp32"), ("b-1", ARCH, "int8-static")])
    out = tmp_path / "out"
    ms = export_run(run, out, test_samples=200, options=TIMED)
    assert set(ms) == {"a-1", "b-1"} and ms["a-1"].quant == "fp32"
    # b-1's plan asks for int8-static; on tier-xs it is measured slower than fp32 (issue 16), so fp32 ships.
    decision, lat = ms["b-1"].extra["quantization"], ms["b-1"].metrics["latency_ms"]
    shipped = "fp32" if lat["int8-static"] >= lat["fp32"] else "int8-static"  # fp32 on x86: int8 ~2x slower
    assert decision["requested"] == "int8-static" and decision["shipped"] == ms["b-1"].quant == shipped, lat
    assert "profile 'unit' cannot be loaded here" in decision["source"]
    calibration = decision.get("calibration") or ms["b-1"].extra["calibration"]
    assert "not available" in calibration["source"]  # no fleet config: the training split
    index = json.loads((out / "index.json").read_text())
    assert [d["id"] for d in index["devices"]] == ["a-1", "b-1"]
    assert [d["quant"] for d in index["devices"]] == ["fp32", shipped]
    assert EdgeModel.load(out / "b-1").predict(digits()[1].x[:3], preprocessed=True).labels.shape == (3,)


GEFL_PROTOCOL = sorted((Path(__file__).resolve().parent.parent / "examples").glob("gefl-protocol-*.toml"))


def test_gefl_protocol_examples_never_inherit_int8(tmp_path: Path) -> None:
    # Issue 16: every device of the gefl-protocol examples runs a GeFL CNN on x86-gateway, whose
    # plan picks int8-static for tier-xl; int8 is only a candidate for the CNN, timed on it.
    from fedge.common.archs import arch_by_name
    from fedge.export.decide import request_quant
    from fedge.fleet.config import load_fleet
    from fedge.fleet.slots import device_profile
    from fedge.profiles import plan

    assert len(GEFL_PROTOCOL) == 6
    candidates = 0
    for path in GEFL_PROTOCOL:
        cfg = load_fleet(path)
        for gi, group in enumerate(cfg.devices):
            p = plan(device_profile(cfg, gi), embed_dim=cfg.run.embed_dim, samples=600)
            for name in group.archs or ([group.arch] if group.arch else [p.arch]):
                arch = arch_by_name(name, embed_dim=cfg.run.embed_dim if name.startswith("tier-") else None).name
                request = request_quant(arch, profile=group.profile, plan=p.to_dict())
                if request.quant.startswith("int8"):
                    assert request.speed_check and f"made for {p.arch} (this model is {arch})" in request.source
                    candidates += 1
    assert candidates == 60  # 6 examples x 10 devices, all planned int8-static for tier-xl
    # And one of them exported for real, from a run laid out as the simulator writes it.
    cfg = load_fleet(GEFL_PROTOCOL[0])
    planned = plan(device_profile(cfg, 0), embed_dim=cfg.run.embed_dim, samples=600).to_dict()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    save_checkpoint(trained("cnn1"), run / "checkpoints" / "client-1.safetensors", extra={"fedge.dataset": "digits"})
    (run / "results.json").write_text(json.dumps({"dataset": "digits", "devices": [
        {"id": "client-1", "profile": "x86-gateway", "arch": "cnn1", "plan": planned}]}))
    m = export_run(run, tmp_path / "out", test_samples=200, options=TIMED)["client-1"]
    decision, lat = m.extra["quantization"], m.metrics["latency_ms"]
    assert decision["requested"] == "int8-static" and set(lat) == {"fp32", "int8-static"}
    assert m.quant == decision["shipped"] == ("fp32" if lat["int8-static"] >= lat["fp32"] else "int8-static"), lat
    if m.quant == "fp32":  # on the x86 hosts this was written on: cnn1 int8 ~2-3x slower than fp32
        assert decision["reason"].startswith("int8-static (from plan of profile 'x86-gateway', made for tier-xl "
                                             "(this model is cnn1)") and decision["reason"].endswith("shipping fp32")


def test_run_export_calibrates_on_the_devices_own_share(tmp_path: Path) -> None:
    # The simulator records its fleet config; the exporter rebuilds the partition from it.
    config = Path(__file__).resolve().parent.parent / "examples" / "demo.toml"
    run = _fake_run(tmp_path / "run", [("x86-gateway-1", ARCH, "int8-static")])
    results = json.loads((run / "results.json").read_text())
    results["config"] = str(config)
    (run / "results.json").write_text(json.dumps(results))
    m = export_run(run, tmp_path / "out", test_samples=100, quant="int8-static", options=FAST)["x86-gateway-1"]
    assert m.quant == "int8-static" and m.extra["quantization"]["source"] == "--quant"
    assert m.extra["calibration"]["source"].startswith("device x86-gateway-1's own training share (")


def test_run_export_is_all_or_nothing(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run", [("a-1", ARCH, "fp32"), ("b-1", ARCH, "fp32")])
    (run / "checkpoints" / "b-1.safetensors").unlink()
    results = json.loads((run / "results.json").read_text())
    results["devices"][0]["arch"] = "tier-m"
    (run / "results.json").write_text(json.dumps(results))
    with pytest.raises(ExportError, match=r"results\.json says device a-1 runs 'tier-m'"):
        export_run(run, tmp_path / "out", options=FAST)
    results["devices"][0]["arch"] = ARCH
    (run / "results.json").write_text(json.dumps(results))
    with pytest.raises(ExportError, match=r"device b-1: no checkpoint .*b-1\.safetensors"):
        export_run(run, tmp_path / "out", options=FAST)
    assert leftovers(tmp_path / "out") == []


def test_run_without_results(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"has no results\.json"):
        export_run(tmp_path, tmp_path / "out")
