"""The MFCC front end inside the model: its maths against numpy/scipy, a pure tone, and ONNX Runtime."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import scipy.fft
import torch

from fedge.common.families import family_arch
from fedge.edge.models.families import build_family_net
from fedge.edge.models.frontend import DEFAULT_MFCC, Mfcc, dct_matrix, dft_kernels, hz_to_mel, mel_filterbank
from fedge.export.onnx_export import export_graphs

S = DEFAULT_MFCC


def reference_mfcc(x: np.ndarray) -> np.ndarray:
    """The same MFCCs the textbook way, in float64: frames, periodic Hann, numpy's rFFT, the filterbank,
    log, scipy's orthonormal DCT-II."""
    t = np.arange(S.window)
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * t / S.window)
    frames = np.stack([x[i * S.hop : i * S.hop + S.window] * hann for i in range(S.frames(len(x)))])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    mel = power[:, : S.bins] @ mel_filterbank(S)
    return scipy.fft.dct(np.log(mel + S.floor), type=2, norm="ortho", axis=1)[:, : S.coefficients]


def speechlike(n: int, seed: int = 0) -> np.ndarray:
    """(n, 16000) clips: a gliding harmonic tone under an envelope, plus noise, peak ~0.5."""
    rng = np.random.default_rng(seed)
    t = np.arange(16_000) / 16_000
    out = []
    for _ in range(n):
        f0 = rng.uniform(90, 250) * (1 + 0.3 * t)
        phase = 2 * np.pi * np.cumsum(f0) / 16_000
        voice = sum(np.sin(k * phase) / k for k in range(1, 8))
        env = np.exp(-((t - rng.uniform(0.3, 0.7)) ** 2) / 0.02)
        out.append(0.3 * voice * env + rng.normal(0, 0.01, t.shape))
    return np.asarray(out, dtype=np.float32)


def test_settings_give_mlperf_tinys_49_by_10_and_the_bins_up_to_4_khz() -> None:
    assert S.frames(16_000) == 49
    assert S.bins == 161  # 4000 Hz is bin 160 of a 640-point DFT at 16 kHz (25 Hz per bin)
    assert Mfcc(16_000).output_shape == (1, 49, 10)
    assert Mfcc(8_000).output_shape == (1, 24, 10)
    with pytest.raises(ValueError, match="shorter than one 640-sample frame"):
        Mfcc(100)


def test_filterbank_triangles_peak_at_their_centres_and_overlap_to_one() -> None:
    fb = mel_filterbank(S)
    assert fb.shape == (S.bins, S.mels)
    edges = np.linspace(hz_to_mel(S.f_min), hz_to_mel(S.f_max), S.mels + 2)
    bin_mel = hz_to_mel(np.arange(S.bins) * 25.0)
    for m in range(S.mels):
        # the bin nearest the centre (in mel) carries the column's largest weight
        assert fb[:, m].argmax() == np.abs(bin_mel - edges[m + 1]).argmin()
        assert fb[:, m].max() > 0.5, f"filter {m} has no bin near its centre"
    # between the second and the second-last centre adjacent triangles sum to 1 at every bin
    inner = (bin_mel >= edges[2]) & (bin_mel <= edges[-3])
    np.testing.assert_allclose(fb[inner].sum(axis=1), 1.0, atol=1e-12)
    assert fb[0].sum() == 0.0  # DC
    # one bin by hand: 1000 Hz = bin 40, mel 999.99; it lies on the falling side of one filter, rising of the next
    mel_1k = 1127 * np.log1p(1000 / 700)
    m = int(np.searchsorted(edges, mel_1k)) - 2  # the filter whose centre is just below 1000 Hz
    assert fb[40, m] == pytest.approx((edges[m + 2] - mel_1k) / (edges[m + 2] - edges[m + 1]))
    assert fb[40, m + 1] == pytest.approx((mel_1k - edges[m + 1]) / (edges[m + 2] - edges[m + 1]))


@pytest.mark.parametrize("freq", [300.0, 1000.0, 2500.0])
def test_a_pure_tone_lights_the_mel_bin_centred_nearest_it(freq: float) -> None:
    t = np.arange(16_000) / 16_000
    clip = torch.from_numpy((0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32))[None, None]
    with torch.no_grad():
        log_mel = Mfcc(16_000).log_mel(clip)[0].numpy()  # (49, 40)
    centres = 700 * np.expm1(np.linspace(hz_to_mel(S.f_min), hz_to_mel(S.f_max), S.mels + 2)[1:-1] / 1127)
    assert int(log_mel.mean(axis=0).argmax()) == int(np.abs(centres - freq).argmin())
    # and every frame agrees (a steady tone)
    assert (log_mel.argmax(axis=1) == np.abs(centres - freq).argmin()).all()


def test_the_dct_and_dft_matrices_equal_scipy_and_numpy() -> None:
    x = np.random.default_rng(1).normal(size=(5, 40))
    np.testing.assert_allclose(x @ dct_matrix(40, 10), scipy.fft.dct(x, type=2, norm="ortho", axis=1)[:, :10],
                               atol=1e-12)
    frame = np.random.default_rng(2).normal(size=S.window)
    k = dft_kernels(S)[:, 0, :]  # (2 * bins, window)
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(S.window) / S.window)
    spec = np.fft.rfft(frame * hann)[: S.bins]
    np.testing.assert_allclose(k[: S.bins] @ frame, spec.real, atol=1e-9)
    np.testing.assert_allclose(k[S.bins :] @ frame, spec.imag, atol=1e-9)


def test_mfccs_equal_the_textbook_computation_in_float64() -> None:
    clips = speechlike(3)
    with torch.no_grad():
        got = Mfcc(16_000)(torch.from_numpy(clips)[:, None]).numpy()  # float32
    assert got.shape == (3, 1, 49, 10)
    for i in range(3):
        want = reference_mfcc(clips[i].astype(np.float64))
        assert np.abs(got[i, 0] - want).max() <= 1e-3, np.abs(got[i, 0] - want).max()
    # silence: every mel energy is the floor, so c0 = sqrt(40) * log(floor) and the rest 0
    with torch.no_grad():
        quiet = Mfcc(16_000)(torch.zeros(1, 1, 16_000))[0, 0].numpy()
    np.testing.assert_allclose(quiet[:, 0], np.sqrt(40) * np.log(S.floor), rtol=1e-6)
    np.testing.assert_allclose(quiet[:, 1:], 0.0, atol=1e-4)


def test_the_front_end_in_onnx_runtime_equals_torch_within_1e_4() -> None:
    mfcc = Mfcc(16_000).eval()
    buf = io.BytesIO()
    torch.onnx.export(mfcc, (torch.zeros(2, 1, 16_000),), buf,  # type: ignore[arg-type]
                      dynamo=False, opset_version=17,
                      input_names=["audio"], output_names=["mfcc"],
                      dynamic_axes={"audio": {0: "batch"}, "mfcc": {0: "batch"}})
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    clips = speechlike(16, seed=3)[:, None]
    got = sess.run(None, {"audio": clips})[0]
    with torch.no_grad():
        want = mfcc(torch.from_numpy(clips)).numpy()
    assert got.shape == (16, 1, 49, 10)
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_a_raw_audio_dscnn_exports_with_its_front_end_and_predicts_as_torch(tmp_path: Path) -> None:
    spec = family_arch("dscnn", "s", in_channels=1, input_size=(16_000,), num_classes=12, embed_dim=64)
    features = family_arch("dscnn", "s", in_channels=1, input_size=(49, 10), num_classes=12, embed_dim=64)
    assert spec.name == "dscnn-s-16000" and spec.input_shape == (1, 16_000)
    assert spec.stem_shape == features.stem_shape == (32, 25, 5)  # the stem sees the same 49x10 MFCCs
    # the front end adds no parameters, the per-coefficient BatchNorm after it 2 x 10
    assert spec.num_params() == features.num_params() + 2 * 10
    assert spec.macs() == features.macs() + Mfcc(16_000).macs_per_sample  # ... and its MACs are counted
    net = build_family_net(spec, seed=0).eval()
    assert not any(k.startswith("extractor.0") for k in net.state_dict())  # its constants are not shared state
    paths = export_graphs(net, tmp_path)
    sess = ort.InferenceSession(str(paths["model"]), providers=["CPUExecutionProvider"])
    assert [tuple(i.shape) for i in sess.get_inputs()] == [("batch", 1, 16_000)]
    clips = speechlike(32, seed=4)[:, None]
    got = sess.run(None, {sess.get_inputs()[0].name: clips})[0]
    with torch.no_grad():
        want = net(torch.from_numpy(clips)).numpy()
    assert np.abs(got - want).max() <= 1e-4
    assert (got.argmax(1) == want.argmax(1)).all()


@pytest.mark.parametrize("quant", ["int8-dynamic", "int8-static", "fp16"])
def test_quantization_leaves_the_front_end_in_float32(tmp_path: Path, quant: str) -> None:
    """int8 (one scale per tensor) would flatten the power spectrum's ten orders of magnitude to the log floor
    and fp16 overflows above 65504: the passes keep the front end's nodes float32, the network's are quantized."""
    import onnx

    from fedge.export.quantize import front_end_nodes, quantize_file

    spec = family_arch("dscnn", "s", in_channels=1, input_size=(16_000,), num_classes=12, embed_dim=64)
    net = build_family_net(spec, seed=0).eval()
    paths = export_graphs(net, tmp_path)
    fp32 = onnx.load(str(paths["model"]))
    names = front_end_nodes(fp32)
    ops = [n.op_type for n in fp32.graph.node if n.name in names]
    assert ops[0] == "Conv" and "Log" in ops and ops[-1] == "MatMul" and ops.count("MatMul") == 2
    clips = speechlike(24, seed=5)[:, None] * np.linspace(0.05, 3.0, 24, dtype=np.float32)[:, None, None]
    clips = np.clip(clips, -1, 1)  # quiet to clipping-loud: the power spectrum exceeds fp16's range on the loud
    out = quantize_file(paths["model"], tmp_path / f"{quant}.onnx", quant, calib=clips, input_name="image")
    q = onnx.load(str(out))
    if quant != "fp16":  # the DFT Conv keeps float32 kernels: a Conv, not a ConvInteger or a QDQ pair
        weights = {t.name: t for t in q.graph.initializer}
        dft = [n for n in q.graph.node if n.op_type == "Conv" and n.input[1] in weights
               and list(weights[n.input[1]].dims) == [2 * S.bins, 1, S.window]]
        assert len(dft) == 1 and weights[dft[0].input[1]].data_type == onnx.TensorProto.FLOAT
    # (fp16: the kept nodes compute in float32 from kernels stored as fp16; the loud clips below would overflow
    # an fp16 power spectrum to infinity)
    assert any(n.op_type in ("ConvInteger", "MatMulInteger", "QLinearConv", "QuantizeLinear", "Cast")
               for n in q.graph.node)  # the rest of the network is quantized
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: clips})[0]
    with torch.no_grad():
        want = net(torch.from_numpy(clips)).numpy()
    assert np.isfinite(got).all()
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9
