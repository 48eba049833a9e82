"""The privacy audit's table and figures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from fedge.audit.findings import GeneratorAudit


def save_closest(path: str | os.PathLike[str], synthetic01: np.ndarray, train01: np.ndarray,
                 audit: GeneratorAudit) -> Path:
    """A figure of the closest synthetic samples (top row) above their nearest training images (bottom row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = max(1, len(audit.closest))
    fig, axes = plt.subplots(2, n, figsize=(1.3 * n, 3.0), squeeze=False)
    for c, (i, j, dist) in enumerate(audit.closest):
        for r, img in enumerate((synthetic01[i, 0], train01[j, 0])):
            ax = axes[r][c]
            ax.imshow(img, cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[0][c].set_title(f"d={dist:.2f}", fontsize=7)
    axes[0][0].set_ylabel("synthetic", fontsize=7)
    axes[1][0].set_ylabel("nearest train", fontsize=7)
    fig.suptitle(f"{audit.generator} on {audit.device}: MND ratio {audit.pixel.ratio:.2f} (pixels), "
                 f"{audit.features.ratio:.2f} (features)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_audit_table(report: dict[str, Any]) -> str:
    """One line per device and generator: the MND ratios (lower = more memorized) and the set sizes."""
    header = ["device", "generator", "level", "train", "held-out", "MND px", "ratio px", "MND feat", "ratio feat"]
    rows = [header]
    for a in report["audits"]:
        rows.append([a["device"], a["generator"], a["level"], str(a["n_train"]), str(a["n_val"]),
                     f"{a['pixel']['synthetic']:.3f}", f"{a['pixel']['ratio']:.3f}",
                     f"{a['features']['synthetic']:.3f}", f"{a['features']['ratio']:.3f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for a in report["audits"]:
        if "roundtrip" in a:
            rt = a["roundtrip"]
            lines.append(f"{a['device']} / {a['generator']}: held-out images through the extractor and the same "
                         f"inverter score ratio {rt['pixel']['ratio']:.3f} px, {rt['features']['ratio']:.3f} feat "
                         "(1: the inverter itself adds no pull towards the training images)")
    lines.append("")
    lines.append("MND ratio = mean nearest-training-image distance of synthetic samples / that of held-out real "
                 "images (1: as far as fresh data; lower: closer to the training images, i.e. memorized)")
    return "\n".join(lines)
