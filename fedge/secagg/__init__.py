"""Secure aggregation (SecAgg+, Bell et al. CCS 2020): the coordinator learns only a group's sum.

Torch-free and transport-free. Layers, bottom up:

* :mod:`~fedge.secagg.fixedpoint` — clipping and fixed-point encoding of float vectors into Z_{2^k}, the
  field size chosen from the group size so that the sum cannot wrap;
* :mod:`~fedge.secagg.shamir` — t-of-n Shamir secret sharing over the prime field GF(2^521 − 1);
* :mod:`~fedge.secagg.crypto` — X25519 key agreement + HKDF, the AEAD that carries shares end to end, and the
  AES-256-CTR stream that expands a seed into a mask;
* :mod:`~fedge.secagg.graph` — each device's neighbours on a ring of logarithmic degree, from the round seed;
* :mod:`~fedge.secagg.messages` — the stage messages: versioned, bounded, validated; a refusal is a named
  reason;
* :mod:`~fedge.secagg.device` and :mod:`~fedge.secagg.server` — the protocol's two halves as pure state
  machines (bytes in, bytes out) for the four stages: advertise keys, share keys, masked input, unmask.

docs/security.md#secure-aggregation says what it protects against and what it does not.
"""

# A stage's deadline after the first (the first waits for the round's training). Here, not in ``rounds``, so the
# coordinator's configuration reads it without loading the protocol's messages and with them `cryptography`
# (``fedge infer`` must not: tests/test_flash_extras.py).
DEFAULT_STAGE_S = 30.0
