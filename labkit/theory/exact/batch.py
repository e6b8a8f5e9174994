"""One rank's microbatch: how many sequences, and how many positions of each its residual stream
holds. Every strategy's theory sizes its tensors and messages from these two numbers."""

from __future__ import annotations

from labkit.config import ModelConfig, ParallelConfig


def microbatch_rows(cfg: ParallelConfig) -> int:
    """Sequences per microbatch on one rank: global_batch / (dp · ep · microbatches) (the engines
    split the global batch over dp x ep, then into microbatches)."""
    return cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)


def stream_rows(cfg: ParallelConfig, model: ModelConfig) -> int:
    """Positions of each sequence in the residual stream a rank holds between blocks (what it
    keeps of a checkpointed block, what a pipeline passes on): s/cp, and s/(cp·tp) under SP."""
    return model.seq // cfg.cp // (cfg.tp if cfg.sequence_parallel else 1)
