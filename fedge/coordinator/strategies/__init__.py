"""Coordinator halves of every method (one module per family); :mod:`fedge.fleet.registry` names them."""
