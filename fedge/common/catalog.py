"""The data sets fedge knows by name, and their classes — known without loading any data.

Torch-free and data-free: the fleet config validates ``[run] dataset`` against it
and the coordinator sizes its aggregates by it, neither of which may need the
images (or torch) to do so. The loaders live in :mod:`fedge.edge.data.datasets`.
"""

from __future__ import annotations

IMAGE_DATASETS = ("fmnist", "mnist", "cifar10", "digits")
# 1-D data sets: audio clips and sensor windows, each sample of a speaker or subject (docs/audio.md, sensors.md)
SIGNAL_DATASETS = ("speech_commands", "espeak_kws", "uci_har")
DATASETS = (*IMAGE_DATASETS, *SIGNAL_DATASETS)

FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                  "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
DIGIT_CLASSES = tuple(str(i) for i in range(10))

# Speech Commands' twelve-class setting: ten commands, silence, unknown (every other word)
KWS_WORDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
KWS_CLASSES = (*KWS_WORDS, "silence", "unknown")
# UCI HAR's activities, in the order of its activity_labels.txt (labels 1..6 there, 0..5 here)
HAR_CLASSES = ("walking", "walking_upstairs", "walking_downstairs", "sitting", "standing", "laying")

# Class names in label order, per data set.
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "fmnist": FMNIST_CLASSES,
    "mnist": DIGIT_CLASSES,
    "cifar10": CIFAR10_CLASSES,
    "digits": DIGIT_CLASSES,
    "speech_commands": KWS_CLASSES,
    "espeak_kws": KWS_CLASSES,
    "uci_har": HAR_CLASSES,
}
# (channels, samples) of one input of a 1-D data set: 1 s of 16 kHz mono audio; 2.56 s of UCI HAR's 9 signals
SIGNAL_SHAPES: dict[str, tuple[int, int]] = {
    "speech_commands": (1, 16_000),
    "espeak_kws": (1, 16_000),
    "uci_har": (9, 128),
}
NUM_CLASSES: dict[str, int] = {name: len(classes) for name, classes in CLASS_NAMES.items()}
