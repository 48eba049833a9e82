"""What runs on a device: models, data, local training, method device halves, the agent."""
