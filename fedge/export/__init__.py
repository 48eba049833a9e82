"""ONNX export, per-profile quantization and verification."""
