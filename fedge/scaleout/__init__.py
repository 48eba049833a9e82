"""Scale-out services beside the coordinator: aggregation workers and relays over MQTT.

``aggregator`` (a partial aggregator over a share of a round, numpy only), ``worker`` (``fedge coordinator
worker``: a share of the updates through an MQTT 5 shared subscription), ``relay`` (``fedge relay``: one broker
shard to its parent) and ``cli`` (both commands). They sit above the MQTT transports and the coordinator's
library, which never import them: the partial's format (``fedge.coordinator.partial``) and its admission
(``fedge.coordinator.merge``) are the engine's half and stay with it. See docs/scale.md.
"""
