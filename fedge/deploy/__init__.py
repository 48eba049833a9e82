"""``fedge deploy``: signed, staged over-the-air model updates to a fleet's devices."""
