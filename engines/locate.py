"""What each module computed in one step, recorded where it ran: the output of every module the
oracle locates by (`RECORDED`: the embedding, each block, its norms, attention and its projections,
the MLP and its linears, the final norm and the LM head's logits) and the gradient that flowed into
that output in backward. The run records its first step on every rank (engines/train.py, `Lab.run(...,
locate=True)`); the one-process reference records the same step with the same hooks
(labkit/oracle/locate.py), which puts the ranks' pieces back together by the layout and names the
first module, in execution order, whose output left the reference's.

What is recorded is what the next operation read: an output is kept as the tensor itself and copied
only once its forward is over, so that an in-place edit after the module (the padding mask that
engines/loss.py `MaskPadding` writes into head.proj's logits) is seen; a gradient is copied when it
arrives. Under activation checkpointing a block's forward runs twice: the first run is recorded, the
recomputation inside backward only hooks its outputs' gradients.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

RECORDED = re.compile(
    r"(embed|head\.(norm|proj)|blocks\.\d+(\.(ln1|ln2|ln1_post|ln2_post|attn|mlp)(\.(wq|wk|wv|wo|fc1|fc2|gate|up|down))?)?)"
)
"""The modules recorded, by their name in the full model (engines/model.py); the same names on every
layout's ranks (tensor parallelism swaps the modules, not their names; a pipeline keeps full names)."""
INPUTS = re.compile(r"blocks\.\d+\.(attn\.(wq|wo)|mlp\.(fc1|fc2|gate|down))")
"""The linears whose input is recorded too, as `<name>.input`: what no recorded module outputs (attention's
core before wo, the activation before fc2 / down, the input operator of tp or SP before wq and fc1), so
that a record whose inputs matched has every input recorded (wk, wv and up read wq's and gate's input)."""


def canonical(name: str) -> str:
    """A module's name in the full model: wrappers' own levels (PyTorch DDP's `module`, torch.compile's
    `_orig_mod`, a checkpoint wrapper's `_checkpoint_wrapped_module`) left out."""
    return ".".join(p for p in name.split(".") if p != "module" and not p.startswith("_"))


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpointed block's recomputation)."""
    return torch._C._current_graph_task_id() != -1


class Recorder:
    """Forward hooks on every recorded module of `chunks` (this rank's modules), each output's gradient
    hooked on the tensor; `finish()` removes the hooks and returns the records as plain data."""

    def __init__(self, chunks: list[nn.Module]):
        self.records: list[dict] = []
        self.order: list[tuple[str, str]] = []  # (name, direction) in the order they first happened
        self.pending: list[tuple[dict, torch.Tensor]] = []  # outputs not yet copied (their forward runs on)
        self.calls: dict[tuple[str, bool], int] = {}  # forwards per module, outside and inside backward
        self.handles = []
        for chunk in chunks:
            for name, module in chunk.named_modules():
                name = canonical(name)
                if RECORDED.fullmatch(name):
                    self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def forward_hook(_module, args, out):
            if not isinstance(out, torch.Tensor):
                return
            again = in_backward()
            mb = self.calls.get((name, again), 0)
            self.calls[name, again] = mb + 1
            tensors = [(name, out)]
            if INPUTS.fullmatch(name) and args and isinstance(args[0], torch.Tensor):
                tensors.insert(0, (name + ".input", args[0]))  # read before the module ran
            for key, t in tensors:
                if not again:
                    self.pending.append(({"name": key, "direction": "forward", "microbatch": mb}, t.detach()))
                    self._seen(key, "forward")
                if t.requires_grad:
                    t.register_hook(lambda g, key=key, mb=mb: self._grad(key, mb, g))

        return forward_hook

    def _seen(self, name: str, direction: str) -> None:
        if (name, direction) not in self.order:
            self.order.append((name, direction))

    def _grad(self, name: str, mb: int, grad: torch.Tensor) -> None:
        self.flush()  # backward has begun: every forward before it is over
        values = grad.detach().cpu().to(torch.float32, copy=True).numpy()
        self.records.append({"name": name, "direction": "backward", "microbatch": mb, "values": values})
        self._seen(name, "backward")

    def flush(self) -> None:
        """Copy the outputs whose forward is over (fp32, on the host)."""
        for record, out in self.pending:
            record["values"] = out.cpu().to(torch.float32, copy=True).numpy()
            self.records.append(record)
        self.pending = []

    def finish(self) -> dict:
        """The hooks removed; {"records": [{name, direction, microbatch, values}], "order": [[name,
        direction]], "bytes": what the records hold}."""
        self.flush()
        for h in self.handles:
            h.remove()
        self.handles = []
        held = sum(r["values"].nbytes for r in self.records)
        return {"records": self.records, "order": [list(o) for o in self.order], "bytes": held}
