"""The built-in model families beside the GeFL CNNs (docs/models.md, "Built-in families").

Every builder follows the family contract (:mod:`fedge.edge.models.families.contract`): it takes a
tier, the input (channels and a spatial or temporal size), the classes and the embedding size, and
returns a module with ``extractor``, ``body``, ``embed`` and ``head``. The stem (``extractor``) is the
same at every tier of a family, so LG-FedAvg and GeFL-F share it across a fleet of mixed tiers; the
body widens (or deepens) with the tier and ends in global average pooling, so any input size works.

* ``mobilenet``: depthwise-separable MobileNetV1-style blocks, width multiplier 0.125 .. 1 (MLPerf
  Tiny's visual wake words runs MobileNetV1 0.25 at 96x96);
* ``resnet8``: three residual stages of one basic block (MLPerf Tiny's image classification; tier ``s``
  has its 16/32/64 channels);
* ``dscnn``: a DS-CNN for 2-D spectral features such as 49x10 MFCCs (MLPerf Tiny's keyword spotting;
  tier ``m`` has its 64 channels and 4 blocks); given 1-D input (raw audio, ``(1, 16000)``) its stem
  starts with the MFCC front end (:mod:`fedge.edge.models.frontend`), which is exported with it;
* ``cnn1d``: 1-D convolutions for multichannel time series (an accelerometer's 3 axes, say).
"""

from __future__ import annotations

import torch
from torch import nn

from fedge.edge.models.frontend import CoefficientNorm, Mfcc

Split = nn.Module  # a module with extractor / body / embed / head attributes


class Parts(nn.Module):
    """The four parts of a built-in family network (its own forward is the composition)."""

    def __init__(self, extractor: nn.Module, body: nn.Module, embed: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.extractor, self.body, self.embed, self.head = extractor, body, embed, head


def _conv_bn(cin: int, cout: int, k: int | tuple[int, int], stride: int | tuple[int, int] = 1,
             groups: int = 1, padding: int | tuple[int, int] | None = None) -> list[nn.Module]:
    pad = padding if padding is not None else (k // 2 if isinstance(k, int) else (k[0] // 2, k[1] // 2))
    return [nn.Conv2d(cin, cout, k, stride, pad, groups=groups, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True)]


def _ds_block(cin: int, cout: int, stride: int) -> list[nn.Module]:
    """Depthwise 3x3 (stride) then pointwise 1x1, each with BN + ReLU."""
    return _conv_bn(cin, cin, 3, stride, groups=cin) + _conv_bn(cin, cout, 1)


# -- MobileNet -----------------------------------------------------------------
MOBILENET_WIDTH = {"xs": 0.125, "s": 0.25, "m": 0.5, "l": 0.75, "xl": 1.0}
MOBILENET_STEM = 8
# (channels at width 1, stride) of each depthwise-separable block after the stem (MobileNetV1's first 7)
MOBILENET_BLOCKS = ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1))


def mobilenet(tier: str, in_channels: int, input_size: tuple[int, ...], num_classes: int, embed_dim: int) -> Split:
    """Stem conv 3x3/2 to 8 channels; seven DS blocks at the tier's width; global pool."""
    width = MOBILENET_WIDTH[tier]
    extractor = nn.Sequential(*_conv_bn(in_channels, MOBILENET_STEM, 3, 2))
    layers: list[nn.Module] = []
    cin = MOBILENET_STEM
    for base, stride in MOBILENET_BLOCKS:
        cout = max(8, int(base * width))
        layers += _ds_block(cin, cout, stride)
        cin = cout
    body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return Parts(extractor, body, nn.Linear(cin, embed_dim), nn.Linear(embed_dim, num_classes))


# -- ResNet-8 ------------------------------------------------------------------
RESNET_WIDTH = {"xs": 0.5, "s": 1.0, "m": 2.0, "l": 3.0, "xl": 4.0}
RESNET_STEM = 16


class BasicBlock(nn.Module):
    """Two 3x3 convs with a shortcut (a 1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                                    if stride != 1 or cin != cout else nn.Identity())
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(out + self.shortcut(x))


def resnet8(tier: str, in_channels: int, input_size: tuple[int, ...], num_classes: int, embed_dim: int) -> Split:
    """Stem conv 3x3 to 16 channels; stages of 16/32/64 x width (strides 1, 2, 2); global pool."""
    w = RESNET_WIDTH[tier]
    extractor = nn.Sequential(*_conv_bn(in_channels, RESNET_STEM, 3))
    blocks: list[nn.Module] = []
    cin = RESNET_STEM
    for base, stride in ((16, 1), (32, 2), (64, 2)):
        cout = int(base * w)
        blocks.append(BasicBlock(cin, cout, stride))
        cin = cout
    body = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return Parts(extractor, body, nn.Linear(cin, embed_dim), nn.Linear(embed_dim, num_classes))


# -- DS-CNN --------------------------------------------------------------------
DSCNN_TIERS = {"xs": (32, 2), "s": (64, 3), "m": (64, 4), "l": (128, 4)}  # (channels, DS blocks)
DSCNN_STEM = 32


def dscnn(tier: str, in_channels: int, input_size: tuple[int, ...], num_classes: int, embed_dim: int) -> Split:
    """Stem conv 10x4/2 over (frames, bins) to 32 channels; a 1x1 to the tier's width; DS blocks; global pool.

    A 1-D ``input_size`` is raw mono audio: the stem starts with the MFCC front end (49 x 10 from 16000
    samples), so the exported model takes samples."""
    channels, blocks = DSCNN_TIERS[tier]
    stem = _conv_bn(in_channels, DSCNN_STEM, (10, 4), 2, padding=(5, 1))
    if len(input_size) == 1:
        if in_channels != 1:
            raise ValueError(f"dscnn on raw audio takes mono clips (1 channel), got {in_channels} channels")
        mfcc = Mfcc(input_size[0])
        stem = [mfcc, CoefficientNorm(mfcc.settings.coefficients), *stem]
    extractor = nn.Sequential(*stem)
    layers = _conv_bn(DSCNN_STEM, channels, 1)
    for _ in range(blocks):
        layers += _ds_block(channels, channels, 1)
    body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return Parts(extractor, body, nn.Linear(channels, embed_dim), nn.Linear(embed_dim, num_classes))


# -- 1-D CNN -------------------------------------------------------------------
CNN1D_TIERS = {"xs": (16, 32), "s": (32, 64), "m": (32, 64, 128), "l": (64, 128, 256)}
CNN1D_STEM = 16


def cnn1d(tier: str, in_channels: int, input_size: tuple[int, ...], num_classes: int, embed_dim: int) -> Split:
    """Stem conv1d k5/2 to 16 channels; per tier, conv1d k5 + BN + ReLU + maxpool 2 blocks; global pool."""
    extractor = nn.Sequential(nn.Conv1d(in_channels, CNN1D_STEM, 5, 2, 2, bias=False), nn.BatchNorm1d(CNN1D_STEM),
                              nn.ReLU(inplace=True))
    layers: list[nn.Module] = []
    cin = CNN1D_STEM
    for cout in CNN1D_TIERS[tier]:
        layers += [nn.Conv1d(cin, cout, 5, 1, 2, bias=False), nn.BatchNorm1d(cout), nn.ReLU(inplace=True),
                   nn.MaxPool1d(2)]
        cin = cout
    body = nn.Sequential(*layers, nn.AdaptiveAvgPool1d(1), nn.Flatten())
    return Parts(extractor, body, nn.Linear(cin, embed_dim), nn.Linear(embed_dim, num_classes))


BUILDERS = {"mobilenet": mobilenet, "resnet8": resnet8, "dscnn": dscnn, "cnn1d": cnn1d}
