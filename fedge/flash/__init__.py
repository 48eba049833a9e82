"""`fedge flash`: put one device of a fleet on its boot medium (docs/flash.md)."""
