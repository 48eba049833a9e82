"""Watching the coordinator: the fleet monitor, the dashboard, /metrics and TensorBoard event files.

It sits above the coordinator's library, which never imports it: the engine reports through its
``observer`` hook (:mod:`fedge.coordinator.observer`), the monitor reads heartbeats through the transport's
protocol (no MQTT here), and ``fedge coordinator run`` wires the two together. See docs/observe.md.
"""
