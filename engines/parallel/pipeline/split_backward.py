"""Backward split in two, as zero-bubble schedules need it (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, section 2): B computes the gradient of the chunk's input only — the one
the previous stage waits for — and W the gradients of the weights, later, from what B kept.

How (the way torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight` do
it, here with the weights' gradients accumulated by autograd itself, so the data-parallel hooks
on them fire as after any backward):
  B   walks the graph from the outputs and finds, for each weight, the nodes on the input's
      path that lead to it (a Linear's matmul node, a LayerNorm's node): its `intermediates`.
      Hooks on those nodes keep the gradient flowing into them; autograd then computes the input
      gradient alone (`inputs=[x]`: a matmul node computes its input side only), keeping the graph.
  W   starts autograd again at those nodes with the kept gradients, towards the weights only
      (`inputs=weights`): each node now computes its weight side. The chunk's graph, and with it
      every activation the chunk saved, is released after W: B keeps the outputs too, so nothing
      is freed in between (torch's pipelining detaches them after B, which frees the nodes above
      the topmost weight, the loss's log-softmax on the last stage; here a microbatch's
      activations live from its F to its W, which is what the theory counts).
A chunk without an input that needs a gradient (the first stage: tokens) has nothing for B to
compute: its W is the whole backward, as in torch's pipelining.
"""

from __future__ import annotations

from collections import defaultdict, deque

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node | None:
    """The node autograd runs for `t`: its grad_fn, or a leaf's AccumulateGrad (made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def _towards_roots(roots: list[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that feed it a gradient (its consumers in forward), for every node reachable."""
    up: dict[Node, list[Node]] = defaultdict(list)
    seen, todo = set(roots), deque(roots)
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            up[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return up


def _closure(starts, up, stop=frozenset()) -> tuple[set, set]:
    """Nodes reached from `starts` going towards the roots, and those of `stop` met on the way
    (not gone through)."""
    out, met, todo = set(starts), set(), deque(starts)
    while todo:
        for node in up.get(todo.popleft(), ()):
            if node in out:
                continue
            if node in stop:
                met.add(node)
                continue
            out.add(node)
            todo.append(node)
    return out, met


class Deferred:
    """What B keeps for W: groups of weights with the nodes where their gradients branch off the
    input's path, and the gradients that flowed into those nodes (`held`: their bytes)."""

    def __init__(self, groups: list[dict], rest: list[torch.Tensor], outputs, seeds):
        self.groups = groups
        self.rest = rest  # weights whose gradient does not branch off the input's path (all, on the first stage)
        self.outputs, self.seeds = outputs, seeds  # the roots, so that the whole graph lives until W
        self.nbytes = 0  # what the memory meter counts as held for W (the executor sets it)

    def held(self) -> list[torch.Tensor]:
        return [g for group in self.groups for grads in group["grads"] for g in grads if g is not None]


def backward_input(
    outputs: list[torch.Tensor], seeds: list, inputs: list[torch.Tensor], weights: list[torch.Tensor]
) -> Deferred:
    """B: accumulate the gradient of `inputs` (leaves that require grad) from `outputs` seeded with
    `seeds`, and keep what W needs. With no input, nothing is computed and W does all."""
    weights = [w for w in weights if w.requires_grad]
    if not inputs:
        return Deferred([], weights, outputs, seeds)
    roots = [n for n in map(grad_node, outputs) if n is not None]
    up = _towards_roots(roots)
    on_path, _ = _closure([grad_node(x) for x in inputs], up)
    groups: dict[Node, dict] = {}  # intermediate -> its group (merged when weights share one)
    rest = []
    for w in weights:
        _, met = _closure([grad_node(w)], up, stop=on_path)
        if not met:
            rest.append(w)
            continue
        group = {"weights": [w], "nodes": set(met)}
        for node in met:
            other = groups.get(node)
            if other is not None and other is not group:
                group["weights"] += [x for x in other["weights"] if all(x is not y for y in group["weights"])]
                group["nodes"] |= other["nodes"]
        for node in group["nodes"]:
            groups[node] = group
    unique = list({id(g): g for g in groups.values()}.values())
    handles = []
    for group in unique:
        group["nodes"] = list(group["nodes"])
        group["grads"] = [None] * len(group["nodes"])
        for i, node in enumerate(group["nodes"]):

            def keep(grad_outputs, group=group, i=i):
                group["grads"][i] = grad_outputs

            handles.append(node.register_prehook(keep))
    try:
        torch.autograd.backward(outputs, seeds, inputs=inputs, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return Deferred(unique, rest, outputs, seeds)


def backward_weight(kept: Deferred) -> None:
    """W: accumulate the weights' gradients from what B kept (autograd's AccumulateGrad, so
    post-accumulate hooks fire), then let the graph go."""
    for group in kept.groups:
        edges, grads, handles = [], [], []
        for node, got in zip(group["nodes"], group["grads"]):
            if got is None:
                continue
            for i, g in enumerate(got):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
            if len(group["nodes"]) > 1:  # a node below another of the group gets its kept gradient, not a second sum
                handles.append(node.register_prehook(lambda grad_outputs, got=got: got))
        try:
            if edges:
                torch.autograd.backward(edges, grads, inputs=group["weights"], retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        group["grads"] = None
    if kept.rest:
        torch.autograd.backward(kept.outputs, kept.seeds, inputs=kept.rest, retain_graph=True)
    kept.groups, kept.rest, kept.outputs, kept.seeds = [], [], None, None  # the graph goes with them
