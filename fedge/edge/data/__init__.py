"""Datasets, the shared preprocessing and fleet partitioners."""
