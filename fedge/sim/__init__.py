"""The whole fleet on one machine: fleet configs, the simulator, reports."""
