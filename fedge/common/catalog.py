"""The data sets fedge knows by name, and their classes — known without loading any data.

Torch-free and data-free: the fleet config validates ``[run] dataset`` against it
and the coordinator sizes its aggregates by it, neither of which may need the
images (or torch) to do so. The loaders live in :mod:`fedge.edge.data.datasets`.
"""

from __future__ import annotations

DATASETS = ("fmnist", "mnist", "cifar10", "digits")

FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                  "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
DIGIT_CLASSES = tuple(str(i) for i in range(10))

# Class names in label order, per data set.
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "fmnist": FMNIST_CLASSES,
    "mnist": DIGIT_CLASSES,
    "cifar10": CIFAR10_CLASSES,
    "digits": DIGIT_CLASSES,
}
NUM_CLASSES: dict[str, int] = {name: len(classes) for name, classes in CLASS_NAMES.items()}
