"""The training data: a synthetic language, or real text (labkit/layout/text.py), batch by batch.

Both are deterministic per (seed, step), so every layout, and the reference, sees exactly the
same global batch at every step. `batch(data, ...)` picks one by the run's `data` argument.

The synthetic language: a fixed random permutation `succ` of the vocabulary; each next token is
`succ[previous]` with probability 3/4, otherwise uniform noise. A model that learns `succ`
lowers the loss from ln(V) toward the noise floor. The permutation comes from a fixed seed
(the language never changes).
"""

from __future__ import annotations

import numpy as np
import torch

from labkit.config import ModelConfig
from labkit.config.choices import Data, trains_on_text
from labkit.layout import text

LANGUAGE_SEED = 1234
FOLLOW_PROB = 0.75


def successor(vocab: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(LANGUAGE_SEED))


def global_batch(step: int, seed: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (batch, seq) int64: the whole step's batch, before any split."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    succ = successor(vocab)
    noise = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    follow = torch.rand(batch, seq + 1, generator=gen) < FOLLOW_PROB
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, 0] = noise[:, 0]
    for t in range(1, seq + 1):
        x[:, t] = torch.where(follow[:, t], succ[x[:, t - 1]], noise[:, t])
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def text_batch(offsets: np.ndarray, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (len(offsets), seq) int64: the corpus windows starting at `offsets`."""
    tokens, targets = text.windows(offsets, seq)
    return torch.from_numpy(tokens), torch.from_numpy(targets)


def batch(
    data: Data, step: int, seed: int, size: int, model: ModelConfig, shapes_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s whole global batch of `size` sequences: data='synthetic' or 'text'.

    shapes_only: a dry run's batch (engines/dryrun.py), the shapes and dtype alone. Its fake tensors
    carry no values, and the synthetic language's token-by-token loop costs ~5 ms a position there:
    40 of a Llama 3.1 8B dry run's 45 s at seq 8192 (cProfile), for a batch nothing reads."""
    if shapes_only:
        tokens = torch.zeros(size, model.seq, dtype=torch.long)
        return tokens, torch.zeros_like(tokens)
    if trains_on_text(data):
        return text_batch(text.train_offsets(step, seed, size, model.seq), model.seq)
    return global_batch(step, seed, size, model.seq, model.vocab)


def shard(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Rows [index * B/count, (index+1) * B/count) of a (B, ...) batch, as a tensor of their own
    (a view would keep the whole batch alive wherever autograd saves it: the loss saves targets)."""
    rows = t.shape[0] // count
    return t[index * rows : (index + 1) * rows].clone()


def microbatches(tokens: torch.Tensor, targets: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a rank's (b, s) batch into m microbatches of b/m rows."""
    return [(shard(tokens, i, m), shard(targets, i, m)) for i in range(m)]
