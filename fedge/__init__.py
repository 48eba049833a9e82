"""fedge: federated learning for fleets of heterogeneous edge devices."""

__version__ = "0.1.0"
