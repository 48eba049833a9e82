"""Conditional generators for generative knowledge transfer (GeFL, GeFL-F, FedVTC): the torch side.

The architectures are plain data in :mod:`fedge.common.generators` (torch-free:
the coordinator sizes and checks uploads with them). This package builds and
trains them: :mod:`~fedge.edge.generators.modules` (the torch modules; importing
it registers their checkpoint builders, so generators save and load like
models), :mod:`~fedge.edge.generators.train` and :mod:`~fedge.edge.generators.grid`::

    from fedge.edge.generators.modules import build_generator, load_generator
    g = build_generator(GeneratorSpec("cvae", (1, 32, 32), tier="small"))
    save_checkpoint(g, "gen.safetensors")
    g2 = load_generator("gen.safetensors", expect=g.spec)
"""
