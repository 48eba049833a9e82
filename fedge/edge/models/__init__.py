"""The heterogeneous model zoo, the model families and self-describing checkpoints."""

from fedge.edge.models.checkpoint import load_checkpoint, register_builder, save_checkpoint
from fedge.edge.models.families import build_family_net
from fedge.edge.models.split import FamilyNet, SplitNet
from fedge.edge.models.zoo import FedgeNet, build_model, build_network, build_seeded

__all__ = ["FamilyNet", "FedgeNet", "SplitNet", "build_family_net", "build_model", "build_network", "build_seeded",
           "load_checkpoint", "register_builder", "save_checkpoint"]
