"""fedge over MQTT: topics, chunking, the paho wrapper, the MQTT transports and the brokers fedge starts.

The wire protocol is specified in ``docs/protocol.md``; everything that touches
paho lives in this package, so methods, the engine and the agent never import it.
"""
