"""Coordinator halves of every method (one module per family); :mod:`fedge.fleet.methods` names them."""
