"""A model family of your own, for `[model] family = "my_family.py:build"` (docs/models.md).

fedge calls ``build`` once per tier the planner considers, holds the result to the contract (four
parts, the shapes, ONNX export) and measures it; each device then trains the tier its hardware holds.
"""

from torch import nn

TIERS = ("s", "m", "l")  # smallest first
WIDTH = {"s": 8, "m": 16, "l": 32}


class TinyNet(nn.Module):
    def __init__(self, width: int, in_channels: int, num_classes: int, embed_dim: int) -> None:
        super().__init__()
        # The stem: the same at every tier, so methods that share it (LG-FedAvg, GeFL-F) can mix tiers.
        self.extractor = nn.Sequential(nn.Conv2d(in_channels, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8),
                                       nn.ReLU())
        self.body = nn.Sequential(
            nn.Conv2d(8, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),  # any input size
        )
        self.embed = nn.Linear(2 * width, embed_dim)  # what FedProto and FedVTC summarise
        self.head = nn.Linear(embed_dim, num_classes)


def build(tier: str, in_channels: int, input_size: tuple[int, ...], num_classes: int, embed_dim: int) -> nn.Module:
    """The network of ``tier`` for inputs of ``in_channels`` x ``input_size``."""
    return TinyNet(WIDTH[tier], in_channels, num_classes, embed_dim)
