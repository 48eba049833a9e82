"""Conditional generators for generative knowledge transfer (GeFL, GeFL-F, FedVTC).

:mod:`~fedge.edge.generators.spec` is torch-free (the coordinator sizes and
checks uploads with it), and importing this package imports nothing else, so
the coordinator never loads torch. The torch side lives in
:mod:`~fedge.edge.generators.modules`, whose classes the checkpoint loader
registers on first use, so generators save and load like models::

    from fedge.edge.generators.modules import build_generator
    g = build_generator(GeneratorSpec("cvae", (1, 32, 32), tier="small"))
    save_checkpoint(g, "gen.safetensors")
    g2 = load_checkpoint("gen.safetensors", expect=ConditionalGenerator)
"""

from __future__ import annotations

from fedge.edge.generators.spec import (
    DEFAULT_GENERATOR_TIER,
    GENERATOR_KINDS,
    GENERATOR_TIERS,
    GeneratorSpec,
    check_tier,
)

__all__ = ["DEFAULT_GENERATOR_TIER", "GENERATOR_KINDS", "GENERATOR_TIERS", "GeneratorSpec", "check_tier"]
