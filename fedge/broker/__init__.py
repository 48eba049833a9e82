"""Broker set-up for real deployments: ``fedge broker config`` writes a Mosquitto config for a fleet."""
