"""The whole fleet on one machine: the simulator, its transports (a table), reports."""
