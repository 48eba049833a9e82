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
