"""What runs beside the broker: the round engine, coordinator halves of methods, checkpoints."""
