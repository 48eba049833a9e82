"""The on-device runtime: no torch, same predictions as PyTorch, images and .npy, damaged exports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import digits, raw_digits, trained
from PIL import Image

from fedge.cli import main
from fedge.common.preprocess import NORMALIZATION, preprocess
from fedge.errors import ExportError, PayloadError
from fedge.export.exporter import ExportOptions, export_model
from fedge.runtime import EdgeModel, load_inputs
from fedge.runtime.manifest import MANIFEST_NAME, sha256_file


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rt") / "fp32"
    export_model(trained(), out, quant="fp32", test=digits()[1], options=ExportOptions(latency_runs=5))
    return out


@pytest.fixture
def copy_dir(model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the export, to damage."""
    dst = tmp_path / "copy"
    dst.mkdir()
    for p in model_dir.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_runtime_does_not_import_torch(model_dir: Path, tmp_path: Path) -> None:
    Image.fromarray(np.full((8, 8), 200, np.uint8)).save(tmp_path / "a.png")
    code = (
        "import sys, numpy as np\n"
        "from fedge.runtime import EdgeModel, load_inputs\n"
        f"m = EdgeModel.load({str(model_dir)!r})\n"
        f"b = load_inputs([{str(tmp_path / 'a.png')!r}], m.norm)\n"
        "p = m.predict(np.zeros((3, 8, 8), np.uint8)); m.embed(b.x, preprocessed=True)\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith(('torch.', 'onnx.', 'onnxscript')))\n"
        "print(len(p.labels), bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "3 []"


def test_infer_command_does_not_import_torch(model_dir: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((2, 8, 8), np.uint8))
    code = (
        "import sys\n"
        "from fedge.cli import main\n"
        f"rc = main(['infer', '--model', {str(model_dir)!r}, {str(tmp_path / 'x.npy')!r}])\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "0 False"


def test_predictions_equal_pytorch_on_at_least_99_percent(model_dir: Path) -> None:
    raw, y = raw_digits()  # 1797 raw 8x8 images through the runtime's own preprocessing
    net = trained()
    with torch.no_grad():
        ref = net(torch.from_numpy(preprocess(raw, NORMALIZATION["digits"]))).argmax(1).numpy()
    model = EdgeModel.load(model_dir)
    pred = model.predict(raw)
    assert (pred.labels == ref).mean() >= 0.99
    assert (pred.labels == y).mean() > 0.85
    assert pred.names[:3] == tuple(str(c) for c in pred.labels[:3])
    assert np.allclose(pred.probs.sum(1), 1.0, atol=1e-5)


def test_batch_1_equals_batched(model_dir: Path) -> None:
    raw, _ = raw_digits()
    model = EdgeModel.load(model_dir)
    batched = model.logits(raw[:20])
    singles = np.concatenate([model.logits(raw[i]) for i in range(20)])  # (8, 8): one image
    assert singles.shape == (20, 10)
    assert np.abs(batched - singles).max() <= 1e-5


def test_extractor_then_head_equals_fused(model_dir: Path) -> None:
    x = digits()[1].x[:16]
    model = EdgeModel.load(model_dir)
    emb = model.embed(x, preprocessed=True)
    assert emb.shape == (16, 64)
    assert np.abs(model.head_logits(emb) - model.logits(x, preprocessed=True)).max() <= 1e-4


def test_images_and_npy_inputs(model_dir: Path, tmp_path: Path) -> None:
    raw, _ = raw_digits()
    u8 = raw.round().astype(np.uint8)
    Image.fromarray(u8[0]).save(tmp_path / "g.png")
    Image.fromarray(np.repeat(u8[1][:, :, None], 3, axis=2)).save(tmp_path / "rgb.jpg", quality=100)
    np.save(tmp_path / "batch.npy", u8[2:5])
    np.save(tmp_path / "pre.npy", preprocess(u8[5:7], NORMALIZATION["digits"]))
    model = EdgeModel.load(model_dir)
    b = load_inputs([tmp_path / "g.png", tmp_path / "rgb.jpg", tmp_path / "batch.npy"], model.norm)
    assert b.names == (str(tmp_path / "g.png"), str(tmp_path / "rgb.jpg"),
                       *(f"{tmp_path / 'batch.npy'}[{i}]" for i in range(3)))
    assert b.x.shape == (5, 1, 32, 32)
    assert np.array_equal(b.x[0], preprocess(u8[:1], model.norm)[0])  # PNG: lossless, the same pixels
    assert np.array_equal(model.predict(b.x[2:], preprocessed=True).labels, model.predict(u8[2:5]).labels)
    pre = load_inputs([tmp_path / "pre.npy"], model.norm, preprocessed=True)
    assert np.array_equal(model.predict(pre.x, preprocessed=True).labels, model.predict(u8[5:7]).labels)


def test_infer_cli(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, _ = raw_digits()
    np.save(tmp_path / "x.npy", raw[:4].round().astype(np.uint8))
    assert main(["infer", "--model", str(model_dir), str(tmp_path / "x.npy"), "--json", "--top", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["input"] for r in rows] == [f"{tmp_path / 'x.npy'}[{i}]" for i in range(4)]
    assert all(len(r["top"]) == 2 and r["top"][0]["prob"] >= r["top"][1]["prob"] for r in rows)
    expect = EdgeModel.load(model_dir).predict(raw[:4].round().astype(np.uint8)).labels
    assert [r["top"][0]["index"] for r in rows] == expect.tolist()
    assert main(["infer", "--model", str(model_dir), str(tmp_path / "x.npy")]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 4


# -- bad input --------------------------------------------------------------------------
def test_wrong_size_of_preprocessed_input(model_dir: Path) -> None:
    model = EdgeModel.load(model_dir)
    with pytest.raises(PayloadError, match=r"shape \(2, 1, 28, 28\), the model expects \(N, 1, 32, 32\)"):
        model.predict(np.zeros((2, 1, 28, 28), np.float32), preprocessed=True)
    with pytest.raises(PayloadError, match=r"embeddings must be \(N, p\)"):
        model.head_logits(np.zeros((2, 4, 4), np.float32))
    with pytest.raises(PayloadError, match=r"head: input of shape \(2, 32\), expected \(N, 64\)"):
        model.head_logits(np.zeros((2, 32), np.float32))


def test_wrong_channel_count(model_dir: Path, tmp_path: Path) -> None:
    model = EdgeModel.load(model_dir)
    with pytest.raises(PayloadError, match=r"shape \(2, 8, 8, 4\): no axis of 1 or 3 channels"):
        model.predict(np.zeros((2, 8, 8, 4), np.uint8))
    with pytest.raises(PayloadError, match=r"shape \(2, 3, 32, 32\), the model expects \(N, 1, 32, 32\)"):
        model.predict(np.zeros((2, 3, 32, 32), np.float32), preprocessed=True)
    np.save(tmp_path / "bad.npy", np.zeros((1, 2, 8, 8), np.uint8))
    with pytest.raises(PayloadError, match=r"bad\.npy has shape \(1, 2, 8, 8\)"):
        load_inputs([tmp_path / "bad.npy"], model.norm)
    with pytest.raises(PayloadError, match="at least 2x2"):
        model.predict(np.zeros((3, 1), np.uint8))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(PayloadError, match=r"unsupported input type \.txt"):
        load_inputs([tmp_path / "x.txt"], model.norm)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(PayloadError, match=r"broken\.png: not a readable image"):
        load_inputs([tmp_path / "broken.png"], model.norm)


def test_checksum_mismatch_names_the_file(copy_dir: Path) -> None:
    data = bytearray((copy_dir / "head.onnx").read_bytes())
    data[-5] ^= 0xFF
    (copy_dir / "head.onnx").write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"head\.onnx: sha256 [0-9a-f]{12}… does not match the manifest's"):
        EdgeModel.load(copy_dir)


def test_truncated_file_is_caught_by_size(copy_dir: Path) -> None:
    data = (copy_dir / "model.onnx").read_bytes()
    (copy_dir / "model.onnx").write_bytes(data[:100])
    with pytest.raises(ExportError, match=rf"model\.onnx: size 100 bytes does not match the manifest's {len(data)}"):
        EdgeModel.load(copy_dir)


def test_corrupt_onnx_with_matching_manifest(copy_dir: Path) -> None:
    # Someone "fixed" the manifest after the file broke: the checksum passes, ONNX Runtime must not.
    path = copy_dir / "model.onnx"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    manifest = json.loads((copy_dir / MANIFEST_NAME).read_text())
    manifest["files"]["model.onnx"] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (copy_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"model\.onnx is not a loadable ONNX model \(corrupt or truncated\?\)"):
        EdgeModel.load(copy_dir)


def test_missing_or_broken_manifest(copy_dir: Path, tmp_path: Path) -> None:
    (copy_dir / "extractor.onnx").unlink()
    with pytest.raises(ExportError, match=r"extractor\.onnx is missing \(listed in manifest\.json\)"):
        EdgeModel.load(copy_dir)
    (copy_dir / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(ExportError, match=r"manifest\.json is not valid JSON"):
        EdgeModel.load(copy_dir)
    with pytest.raises(ExportError, match=r"has no manifest\.json"):
        EdgeModel.load(tmp_path)
    (copy_dir / MANIFEST_NAME).write_text(json.dumps({"format": "fedge-onnx/1"}))
    with pytest.raises(ExportError, match=r"missing keys \['arch', 'quant'"):
        EdgeModel.load(copy_dir)


def test_infer_cli_reports_bad_input(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "bad.npy", np.zeros((1, 4, 4, 4), np.uint8))
    assert main(["infer", "--model", str(model_dir), str(tmp_path / "bad.npy")]) == PayloadError.exit_code
    assert "no axis of 1 or 3 channels" in capsys.readouterr().err
    assert main(["infer", "--model", str(tmp_path), str(tmp_path / "bad.npy")]) == ExportError.exit_code
    assert "has no manifest.json" in capsys.readouterr().err


# -- silently wrong answers (issue 16): handled correctly or refused ---------------------
def test_16bit_png_is_scaled_not_clipped(model_dir: Path, tmp_path: Path) -> None:
    raw, _ = raw_digits()
    u8 = raw[:6].round().astype(np.uint8)
    model = EdgeModel.load(model_dir)
    for i, img in enumerate(u8):
        Image.fromarray(img.astype(np.uint16) * 257).save(tmp_path / f"d{i}.png")  # 16-bit grey: 0..65535
    with Image.open(tmp_path / "d0.png") as im:
        assert im.mode == "I;16"
    b = load_inputs(sorted(tmp_path.glob("d*.png")), model.norm)
    assert np.abs(b.x - preprocess(u8, model.norm)).max() < 1e-5  # the same image as its 8-bit original
    assert np.array_equal(model.predict(b.x, preprocessed=True).labels, model.predict(u8).labels)
    Image.fromarray(u8[0].astype(np.uint16) * 257).save(tmp_path / "d0.tiff")  # 16-bit TIFF: the same rule
    assert np.abs(load_inputs([tmp_path / "d0.tiff"], model.norm).x - b.x[:1]).max() < 1e-5
    Image.fromarray(u8[0].astype(np.int32) * 257).save(tmp_path / "i.tiff")  # mode "I" holding 16-bit values
    assert np.abs(load_inputs([tmp_path / "i.tiff"], model.norm).x - b.x[:1]).max() < 1e-5
    Image.fromarray(u8[0].astype(np.int32)).save(tmp_path / "i8.tiff")  # mode "I", values 0..255: which range?
    with pytest.raises(PayloadError, match=r"i8\.tiff: a 32-bit integer image whose values all lie within 0\.\.255"):
        load_inputs([tmp_path / "i8.tiff"], model.norm)
    Image.fromarray(u8[0].astype(np.float32)).save(tmp_path / "f.tiff")  # mode "F": no defined pixel range
    with pytest.raises(PayloadError, match=r"f\.tiff: a 32-bit floating point image; pixels must be 8 or 16-bit"):
        load_inputs([tmp_path / "f.tiff"], model.norm)
    # Arrays of 16-bit pixels: refused at the 0..255 default, right with max_value.
    with pytest.raises(PayloadError, match=r"images has values up to 65535, above the raw pixel range 0\.\.255"):
        model.predict(u8.astype(np.uint16) * 257)
    assert np.array_equal(model.predict(u8.astype(np.uint16) * 257, max_value=65535).labels,
                          model.predict(u8).labels)


def test_one_hwc_image_is_one_image(model_dir: Path, tmp_path: Path) -> None:
    raw, _ = raw_digits()
    grey = raw[0].round().astype(np.uint8)
    rgb = np.repeat(grey[:, :, None], 3, axis=2)  # (8, 8, 3): one image, not 8 images of 8x3
    model = EdgeModel.load(model_dir)
    pred = model.predict(rgb)
    assert pred.labels.shape == (1,) and pred.labels[0] == model.predict(grey).labels[0]
    np.save(tmp_path / "rgb.npy", rgb)
    b = load_inputs([tmp_path / "rgb.npy"], model.norm)
    assert b.names == (str(tmp_path / "rgb.npy"),) and b.x.shape == (1, 1, 32, 32)
    with pytest.raises(PayloadError, match=r"images has shape \(8, 8, 4\): one RGBA image \(H, W, 4\)\?"):
        model.predict(np.zeros((8, 8, 4), np.uint8))


def test_nan_and_infinity_are_refused(model_dir: Path) -> None:
    model = EdgeModel.load(model_dir)
    with pytest.raises(PayloadError) as err:
        model.predict(np.full((2, 8, 8), np.nan, np.float32))
    assert err.value.message == "images holds 128 NaN or infinite values (of 128): no prediction can be made"
    x = digits()[1].x[:3].copy()
    x[1, 0, 5, 5] = np.inf
    with pytest.raises(PayloadError, match=r"^input holds 1 NaN or infinite values \(of 3072\)"):
        model.logits(x, preprocessed=True)
    for fn in (model.logits, model.predict, model.embed):
        with pytest.raises(PayloadError, match=r"input holds 1024 NaN or infinite values \(of 1024\)"):
            fn(np.full((1, 1, 32, 32), np.nan, np.float32), preprocessed=True)


def test_preprocessed_npy_without_the_flag_is_refused(model_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    raw, _ = raw_digits()
    model = EdgeModel.load(model_dir)
    pre = preprocess(raw[:4], model.norm)
    np.save(tmp_path / "pre.npy", pre)
    lo = float(pre.min())
    expect = (f"{tmp_path / 'pre.npy'} holds negative values (min {lo:.3g}): raw pixels are 0..255 "
              "(this looks like an already preprocessed model input)")
    with pytest.raises(PayloadError) as err:
        load_inputs([tmp_path / "pre.npy"], model.norm)
    assert err.value.message == expect and "--preprocessed" in (err.value.hint or "")
    assert main(["infer", "--model", str(model_dir), str(tmp_path / "pre.npy")]) == PayloadError.exit_code
    assert expect in capsys.readouterr().err
    assert main(["infer", "--model", str(model_dir), "--preprocessed", str(tmp_path / "pre.npy")]) == 0
    # Floats scaled to 0..1 would be read as an almost black 0..255 image.
    with pytest.raises(PayloadError, match=r"images holds floats within 0\.\.1 \(max 1\), but raw pixels are 0\.\.255"):
        model.predict(raw[:2] / 255.0)
    assert np.array_equal(model.predict(raw[:2] / 255.0, max_value=1.0).labels, model.predict(raw[:2]).labels)
    # And the other way round: raw pixels marked as preprocessed.
    resized = preprocess(raw[:2], model.norm) * model.norm.std * 255 + model.norm.mean * 255  # 0..255, 32x32
    with pytest.raises(PayloadError, match=r"^input does not look preprocessed: its root mean square is \d+"):
        model.logits(resized.astype(np.float32), preprocessed=True)


def test_fast_path_equals_full_path(model_dir: Path) -> None:
    model = EdgeModel.load(model_dir)
    x = digits()[1].x[:300]  # float32, contiguous: the fast path for up to batch_size images
    slow = model.run("model", x)
    assert np.abs(model.logits(x[:7], preprocessed=True) - slow[:7]).max() == 0
    for i in range(3):  # batch 1: the inlined path of logits and predict
        assert np.abs(model.logits(x[i : i + 1], preprocessed=True) - slow[i : i + 1]).max() <= 1e-6
        assert model.predict(x[i : i + 1], preprocessed=True).labels.tolist() == [int(slow[i].argmax())]
    assert np.abs(model.logits(x, preprocessed=True) - slow).max() <= 1e-5  # 300 > 256: chunked
    assert np.abs(model.logits(x[:7].astype(np.float64), preprocessed=True) - slow[:7]).max() <= 1e-6
    strided = np.ascontiguousarray(np.repeat(x[:5], 2, axis=0))[::2]  # non-contiguous view
    assert np.abs(model.logits(strided, preprocessed=True) - slow[:5]).max() <= 1e-6
    pred = model.predict(x[:7], preprocessed=True)
    assert pred.labels.tolist() == slow[:7].argmax(1).tolist()
    assert pred.names == tuple(model.classes[i] for i in pred.labels)


# -- tracebacks become errors --------------------------------------------------------------
def test_manifest_normalization_must_hold_numbers(copy_dir: Path) -> None:
    manifest = json.loads((copy_dir / MANIFEST_NAME).read_text())
    for key, value, expect in [("size", "big", "an integer of at least 2, got 'big'"),
                               ("std", 0, "a positive number, got 0"), ("channels", 2, "1 or 3, got 2"),
                               ("mean", None, "a number, got None")]:
        bad = json.loads(json.dumps(manifest))
        bad["normalization"][key] = value
        (copy_dir / MANIFEST_NAME).write_text(json.dumps(bad))
        with pytest.raises(ExportError) as err:
            EdgeModel.load(copy_dir)
        assert err.value.message == f"{copy_dir / MANIFEST_NAME}: normalization.{key} must be {expect}"


def test_manifest_entries_of_the_wrong_kind_are_errors(copy_dir: Path) -> None:
    manifest = json.loads((copy_dir / MANIFEST_NAME).read_text())
    for key, value, expect in [
        ("input_shape", 5, "'input_shape' must be a list such as [\"batch\", 1, 32, 32], got 5"),
        ("metrics", "fast", "'metrics' must be an object, got 'fast'"),
        ("quantization", ["fp32"], "'quantization' must be an object, got ['fp32']"),
        ("profile", 3, "'profile' must be a profile name, got 3"),
    ]:
        bad = {**manifest, key: value}
        (copy_dir / MANIFEST_NAME).write_text(json.dumps(bad))
        with pytest.raises(ExportError) as err:
            EdgeModel.load(copy_dir)
        assert err.value.message == f"{copy_dir / MANIFEST_NAME}: {expect}"


def test_class_list_must_match_the_model(copy_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((copy_dir / MANIFEST_NAME).read_text())
    manifest["classes"] = ["a", "b", "c"]
    (copy_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ExportError) as err:
        EdgeModel.load(copy_dir)
    assert err.value.message == f"{copy_dir / MANIFEST_NAME} lists 3 classes, but model.onnx outputs 10 logits"
    np.save(copy_dir.parent / "x.npy", np.zeros((1, 8, 8), np.uint8))
    assert main(["infer", "--model", str(copy_dir), str(copy_dir.parent / "x.npy")]) == ExportError.exit_code
    assert "lists 3 classes, but model.onnx outputs 10 logits" in capsys.readouterr().err


def test_directory_input_classifies_every_image(model_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    raw, _ = raw_digits()
    u8 = raw[:5].round().astype(np.uint8)
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        Image.fromarray(u8[i]).save(images / f"{i}.png")
    np.save(images / "more.npy", u8[3:5])
    (images / "notes.txt").write_text("not an image")
    (images / "sub").mkdir()
    expect = EdgeModel.load(model_dir).predict(u8).labels.tolist()
    assert main(["infer", "--model", str(model_dir), str(images), "--out", str(tmp_path / "p.csv")]) == 0
    lines = (tmp_path / "p.csv").read_text().splitlines()
    assert lines[0] == "input,rank,class,index,prob" and len(lines) == 6
    assert [ln.split(",")[0] for ln in lines[1:]] == [str(images / f"{i}.png") for i in range(3)] + [
        f"{images / 'more.npy'}[{i}]" for i in range(2)]
    assert [int(ln.split(",")[3]) for ln in lines[1:]] == expect
    assert main(["infer", "--model", str(model_dir), str(images), "--top", "2", "--out",
                 str(tmp_path / "p.json")]) == 0
    rows = json.loads((tmp_path / "p.json").read_text())
    assert [r["top"][0]["index"] for r in rows] == expect and all(len(r["top"]) == 2 for r in rows)
    assert "wrote 5 predictions to" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["infer", "--model", str(model_dir), str(empty)]) == PayloadError.exit_code
    err = capsys.readouterr().err
    assert f"{empty}: a directory with no images, .npy arrays, WAV clips or .csv windows" in err
    assert "subdirectories" in err
    assert main(["infer", "--model", str(model_dir), str(tmp_path / "nope.png")]) == PayloadError.exit_code
    assert f"{tmp_path / 'nope.png'}: no such file or directory" in capsys.readouterr().err
    assert main(["infer", "--model", str(model_dir), str(images), "--out", str(tmp_path / "p.txt")]) == 2
    assert "write a .csv or a .json file" in capsys.readouterr().err


def test_progress_line_needs_no_tqdm() -> None:
    # fedge infer's progress display: drawn in place on a terminal, nothing when redirected.
    import io

    from fedge.common.progress import Progress

    shown = io.StringIO()
    with Progress(5, desc="classifying", unit="file", stream=shown, enabled=True, interval=0) as bar:
        bar.update(2)
        bar.update(3)
    assert shown.getvalue() == "\rclassifying: 2/5 files (40%)\rclassifying: 5/5 files (100%)\n"
    redirected = io.StringIO()  # not a terminal
    with Progress(5, desc="classifying", unit="file", stream=redirected) as bar:
        bar.update(5)
    assert redirected.getvalue() == "" and bar.done == 5


# -- execution providers -------------------------------------------------------------------
def test_provider_order_and_choice() -> None:
    from fedge.errors import ConfigError
    from fedge.runtime.providers import select

    present = ["AzureExecutionProvider", "CPUExecutionProvider", "CUDAExecutionProvider",
               "TensorrtExecutionProvider"]
    assert select(present=present) == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert select(present=["AzureExecutionProvider", "CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert select(["CUDAExecutionProvider"], present=present) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(ConfigError) as err:
        select(["CUDAExecutionProvider"], present=["CPUExecutionProvider"])
    assert err.value.message == ("execution provider CUDAExecutionProvider is not available in this ONNX Runtime "
                                 "(available: CPUExecutionProvider)")


def test_infer_reports_the_provider_that_ran(model_dir: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import onnxruntime as ort

    from fedge.runtime.providers import select

    model = EdgeModel.load(model_dir)
    assert model.providers == select() and model.provider == select()[0]
    assert model.providers == model.session("model").get_providers()
    np.save(tmp_path / "x.npy", np.zeros((1, 8, 8), np.uint8))
    assert main(["infer", "--model", str(model_dir), str(tmp_path / "x.npy"), "-v"]) == 0
    out = capsys.readouterr()
    assert f"execution provider: {model.provider} (session providers: {', '.join(model.providers)}; " \
           f"available here: {', '.join(ort.get_available_providers())})" in out.err
    assert "tier-xs as fp32, 10 classes, 3 files verified" in out.err and len(out.out.splitlines()) == 1
    assert main(["infer", "--model", str(model_dir), "--check"]) == 0
    assert f"execution provider: {model.provider}" in capsys.readouterr().out
    assert main(["infer", "--model", str(model_dir), "--provider", "NoSuchExecutionProvider", "--check"]) == 2
    assert "execution provider NoSuchExecutionProvider is not available" in capsys.readouterr().err
