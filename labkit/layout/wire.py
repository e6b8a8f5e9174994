"""The ring model: bytes one rank sends for each collective, the table the comm meter
(engines/meters/comm.py) records and the theory predicts with, so the two agree to the byte.

B is the bytes of the full (logical) tensor, n the group size. Gloo runs some of these
differently on the wire (reduce-scatter as an all-reduce); labkit counts the algorithm, as
the papers do (DERIVATIONS.md, "The ring model").
"""

from __future__ import annotations

WIRE = {
    "all_reduce": lambda B, n: 2 * (n - 1) / n * B,
    "all_gather": lambda B, n: (n - 1) / n * B,
    "reduce_scatter": lambda B, n: (n - 1) / n * B,
    "all_to_all": lambda B, n: (n - 1) / n * B,
    "broadcast": lambda B, n: (n - 1) / n * B,
    "reduce": lambda B, n: (n - 1) / n * B,
    "scatter": lambda B, n: (n - 1) / n * B,  # at the root; the others send nothing
    "gather": lambda B, n: B / n,  # from each non-root; the root sends nothing
    "send": lambda B, n: B,
    "recv": lambda B, n: 0,
    "barrier": lambda B, n: 0,
    "new_group": lambda B, n: 0,  # group creation, logged by the runtime (not a transfer)
}
