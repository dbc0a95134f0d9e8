"""The network model every planner and predictor shares: host links and a per-message cost.

Each host has an egress and an ingress link (full duplex, as real NICs and `tc tbf` on both veth ends
of the emulated cluster are) at `nic_bytes_per_s` each, and a separate intra-host link for copies
between its own devices. Every message (one chunk of one step) costs `message_s` on top of its bytes.
"""
from __future__ import annotations

import math

# Per-message cost on the emulated cluster (gloo point-to-point over a tbf-shaped veth, 2 cores):
# fitted to DESIGN.md's chain measurements (64 MiB over 1 gbit, K = 16..256 chunks, 1-3 hops).
DEFAULT_MESSAGE_S = 50e-6
MAX_AUTO_CHUNKS = 256  # more chunks gain < 1% at any size measured, and every chunk is a plan step


def auto_chunks(nbytes: int, hops: int, nic_bytes_per_s: float, message_s: float = DEFAULT_MESSAGE_S) -> int:
    """K for a broadcast chain over `hops` receiving hosts: the K that minimises
    (K + hops - 1) * (t / K + message_s), t = nbytes / rate, i.e. K = sqrt((hops - 1) * t / message_s).
    One hop gains nothing from chunks (K = 1); a free message would want K as large as allowed."""
    if hops <= 1:
        return 1
    if message_s <= 0:
        return MAX_AUTO_CHUNKS
    t = nbytes / nic_bytes_per_s
    best = math.sqrt((hops - 1) * t / message_s)
    # The optimum of a convex function of K lies next to the real one: try both integer neighbours.
    lo = max(1, min(MAX_AUTO_CHUNKS, math.floor(best)))
    hi = max(1, min(MAX_AUTO_CHUNKS, math.ceil(best)))
    return min((lo, hi), key=lambda k: ((k + hops - 1) * (t / k + message_s), k))
