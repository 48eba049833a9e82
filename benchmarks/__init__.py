"""fedge's benchmarks: scripts that measure, not tests. Each runs as ``python -m benchmarks.NAME`` from
the repository root, writes JSON under ``benchmarks/results/`` and, where it says so, rewrites its
section of ``docs/results.md``; ``benchmarks/README.md`` lists them. :mod:`benchmarks.common` holds
what they share."""
