"""Generative knowledge transfer on Fashion-MNIST (GeFL, GeFL-F, FedVTC; issue 3), run as
``python -m benchmarks.generative`` (:mod:`benchmarks.generative.__main__` picks each table's cells
and writes the docs).

The parts: :mod:`~benchmarks.generative.rows` (what each table runs), :mod:`~benchmarks.generative.runner`
(running and caching cells), :mod:`~benchmarks.generative.targets` (the targets, as data),
:mod:`~benchmarks.generative.render` (tables, checks against the targets, plots) and
:mod:`~benchmarks.generative.personal` (issue 17's blocks: personal head and guard against Local).
"""
