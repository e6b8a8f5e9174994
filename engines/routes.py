"""What each MoE layer routed, step by step: the choices the oracle's reference replays.

A run in bf16 computes its router's logits in another arithmetic than the fp32 reference, so a
token whose top-k choice is within that arithmetic's error of a tie may go to other experts in the
run than in the reference — a discrete choice that no bound on rounding holds (DERIVATIONS.md,
"The oracle's bounds"). The reference therefore routes as the run routed wherever the two differ
within that error (labkit/oracle/replay.py), and needs the run's choices: every MoE layer records
the experts (b, s, k) of each forward here, by the microbatch the forward belongs to. The rank
sends them as plain data; the notebook places them in the global batch (labkit/oracle/routes.py).
"""

from __future__ import annotations

import torch


class RouteLog:
    """One run's routing on this rank: per step, {layer: {microbatch: experts (b, s, k)}}.

    The microbatch is read off the innermost forward span of the timeline (engines/meters/timeline.py):
    a pipeline stage runs its microbatches in its schedule's order, not always 0, 1, 2, .... A forward
    rerun by activation checkpointing routes again (MoE.counting is off then) and is not recorded:
    the same weights and inputs choose the same experts."""

    def __init__(self, timeline):
        self.timeline = timeline
        self.steps: list[dict[int, dict[int, list]]] = []

    def begin_step(self) -> None:
        self.steps.append({})

    def record(self, layer: int, expert: torch.Tensor) -> None:
        """The experts a forward of MoE layer `layer` chose: (b, s, k) global expert ids."""
        forward = next((ev for ev in reversed(self.timeline.open) if ev["kind"] in ("F", "B", "W")), None)
        if forward is None or forward["kind"] != "F" or not self.steps:
            return
        # int16: E <= 32,767 experts (DeepSeek-V3 has 256); plain nested lists cross to the notebook
        self.steps[-1].setdefault(layer, {})[forward["microbatch"] or 0] = expert.to(torch.int16).cpu().tolist()

    def report(self) -> list[dict]:
        """Per step: {layer: {microbatch: experts as nested lists (b, s, k)}}."""
        return self.steps
