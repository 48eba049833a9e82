"""Conditional generators for generative knowledge transfer (GeFL, GeFL-F, FedVTC).

:mod:`~fedge.edge.generators.spec` is torch-free (the coordinator sizes and
checks uploads with it); the torch side (modules, training, image grids) is
imported only where torch is installed, and registers its classes with the
checkpoint loader so generators save and load like models::

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

try:  # the coordinator may run without torch: it needs only the spec above
    import torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised on torch-less coordinator installs
    pass
else:
    from fedge.edge.generators.modules import (
        CVAE,
        ConditionalDCGAN,
        ConditionalGenerator,
        VTCDecoder,
        build_generator,
        load_generator,
        register_builders,
    )

    register_builders()
    __all__ += ["CVAE", "ConditionalDCGAN", "ConditionalGenerator", "VTCDecoder", "build_generator", "load_generator"]
