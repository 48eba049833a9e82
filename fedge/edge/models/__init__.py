"""The heterogeneous model zoo and self-describing checkpoints."""

from fedge.edge.models.checkpoint import load_checkpoint, register_builder, save_checkpoint
from fedge.edge.models.zoo import FedgeNet, build_model, build_seeded

__all__ = ["FedgeNet", "build_model", "build_seeded", "load_checkpoint", "register_builder", "save_checkpoint"]
