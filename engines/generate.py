"""Text from trained parameters: the model sampled one byte at a time, in this process, on the CPU.

A run on text brings back its final full parameters (RunResult.params), so sampling needs no
engine and no layout: labkit's own model (engines/model.py) is built, the parameters are copied
in, and each next byte is drawn from the logits at the last position. It is exact and simple,
not fast: no KV cache, the whole window (the last `seq` bytes, the positions the model learned)
is recomputed for every byte — a fraction of a second for a few hundred bytes of a small model.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from labkit.config import ConfigError, ModelConfig
from labkit.engines.model import build_model
from labkit.engines.parallel.pipeline import Chunk
from labkit.layout import text


def generate_problems(model: ModelConfig, prompt, tokens, temperature, seed) -> list[str]:
    bad = []
    if model.vocab < text.VOCAB:
        bad.append(f"generate writes bytes (ids 0-255) but ModelConfig.vocab={model.vocab}; train with vocab=256")
    if not isinstance(prompt, str) or not prompt:
        bad.append(f"prompt={prompt!r} must be a non-empty str (the model continues it); try 'ROMEO.\\n'")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        bad.append(f"tokens={tokens!r} must be a whole number >= 0 (bytes to generate); try 200")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        bad.append(f"temperature={temperature!r} must be a number >= 0 (0: greedy); try 0.8")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        bad.append(f"seed={seed!r} must be a whole number >= 0; try 0")
    return bad


def generate(
    model: ModelConfig,
    params: dict[str, np.ndarray],
    prompt: str,
    tokens: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """`tokens` bytes that continue `prompt`, as a str of `tokens` characters (one per byte: a byte
    outside ASCII, which the corpus never has, shows as U+FFFD). temperature 0 takes the most
    likely byte every time (greedy); above 0 samples softmax(logits / temperature) with a
    generator seeded by `seed`, so the same seed gives the same text."""
    bad = generate_problems(model, prompt, tokens, temperature, seed)
    if bad:
        raise ConfigError(bad)
    net = build_model(model, 0)  # the shapes; every value is replaced by `params`
    missing = sorted({n for n, _ in net.named_parameters()} - set(params))
    if missing:
        raise ConfigError([f"the parameters do not cover the model {model}: missing {missing[:3]}"])
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(params[name], dtype=np.float32)))
    # the whole model as one pipeline chunk: without targets its last stage returns the logits
    whole = Chunk(net, range(model.layers), first=True, last=True)
    gen = torch.Generator().manual_seed(seed)
    ids, out = text.encode(prompt), []
    with torch.no_grad():
        for _ in range(tokens):
            window = torch.tensor([(ids + out)[-model.seq :]])  # (1, s <= seq)
            logits = whole(window)[0, -1, : text.VOCAB].float()  # (V,) -> the 256 byte ids
            if temperature == 0:
                out.append(int(logits.argmax()))
            else:
                out.append(int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)))
    return "".join(text.decode([i]) for i in out)
