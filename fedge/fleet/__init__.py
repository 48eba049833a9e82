"""The fleet layer: the fleet config, device ids and building each device — what every role reads."""
