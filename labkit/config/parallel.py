"""How to lay it out: ParallelConfig, one layout of the parallel strategies on the device mesh,
its fields checked when built (validation.py), its choices decoded once (choices.py)."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.config import choices
from labkit.config.base import _Dict
from labkit.config.choices import (
    DIMS,
    Checkpointing,
    ContextComm,
    ContextKind,
    Impl,
    Numerics,
    PipelineShape,
    Precision,
    Recomputation,
    Recompute,
    Schedule,
    Sharded,
    Sharding,
)
from labkit.config.float8 import Float8Scaling, Fp8Recipe, float8_scaling
from labkit.config.validation import check_fields


@dataclass(frozen=True)
class ParallelConfig(_Dict):
    """One layout of the parallel strategies on the device mesh."""

    dp: int = 1
    """Data-parallel degree: replicas (or shards, with sharding) that see different samples."""
    tp: int = 1
    """Tensor-parallel degree (Megatron): attention heads, MLP width and vocabulary split."""
    pp: int = 1
    """Pipeline-parallel degree: layers split into stages that pass activations."""
    cp: int = 1
    """Context-parallel degree: the sequence split over ranks (zigzag), attention as cp_kind says."""
    ep: int = 1
    """Expert-parallel degree: ranks that share the experts and split the batch (needs experts > 0)."""
    sharding: Sharding = "none"
    """'none' (DDP), 'zero1', 'zero2', 'zero3' (ZeRO stages) or 'fsdp' (per-block units)."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout regions along the sequence inside a TP group (needs tp > 1)."""
    microbatches: int = 1
    """Microbatches per step: pipeline microbatches, or gradient accumulation when pp == 1."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b', 'interleaved' (needs virtual_stages > 1), or a
    zero-bubble one, whose backward is split into input and weight gradients: 'zbh1' (1F1B's
    memory), 'zbv' and 'dualpipev' (two chunks per rank in a V: virtual_stages=2)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B; 2 for the V schedules)."""
    stage_layers: tuple[int, ...] = ()
    """Blocks of each virtual stage, in stage order (pp * virtual_stages entries summing to the
    model's layers), for uneven stages: Llama 3.1 405B's 126 layers on 8 stages as
    (15, 16, 16, 16, 16, 16, 16, 15). Empty: layers split evenly."""
    global_batch: int = 8
    """Sequences per optimizer step, over all data-parallel ranks and microbatches."""
    impl: Impl = "lab"
    """'lab' runs labkit's readable implementations; 'torch' runs PyTorch's own (DDP, FSDP2, DTensor, pipelining)."""
    precision: Precision = "fp32"
    """'fp32'; 'bf16': bf16 compute with fp32 master weights and optimizer state; 'fp8': as bf16,
    with the blocks' linear layers' matmuls in fp8 (torchao's float8 training, as torchtitan
    converts them: engines/float8.py) and, per tensor, FSDP's all-gather of their weights in fp8."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """precision='fp8': 'tensorwise' (one dynamic scale per tensor; torchao's default, the one that
    gathers FSDP's weights and shards TP's activations in fp8) or 'rowwise' (a power-of-two scale
    per row; collectives stay bf16). 'mxfp8' and 'delayed' are refused by name (not built)."""
    checkpoint_activations: Checkpointing = False
    """Recompute in backward instead of keeping: False; True or 'full' (each block keeps its input
    only, Chen et al. 2016); 'selective' (the attention core only, Korthikanti et al. 2022, section
    4.2); 'op' (torchtitan's per-op policy: every matmul's output but every second, and the
    attention's, kept; the theory only)."""
    order: str = "tp-cp-ep-dp-pp"
    """Mesh order, innermost (fastest-varying rank) first. Neighbouring ranks share the inner dims."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB for DDP-style reduction (PyTorch DDP's bucket_cap_mb)."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3 traffic) or keep them (ZeRO-2-like)."""
    cp_kind: ContextKind = "ring"
    """How the cp ranks attend across their shards (Megatron's --cp-comm-type): 'ring' (K/V passed
    round, p2p), 'allgather' (K/V gathered once per layer, all_gather), 'ulysses' (all-to-all from
    sequence to head shards and back, a2a; heads and KV heads per tp rank must divide by cp),
    'hierarchical' (a2a+p2p: Ulysses inside runs of cp_a2a consecutive cp ranks, the ring across)."""
    cp_a2a: int = 1
    """cp_kind='hierarchical': the ranks of each all-to-all (consecutive cp coordinates), the ring across
    cp / cp_a2a of them (Megatron's --hierarchical-context-parallel-sizes). 1 for every other kind."""
    dp_replicate: int = 1
    """HSDP (torchtitan's dp_replicate x dp_shard): dp as replicas of shard groups of dp / dp_replicate ranks,
    the sharding inside a group, its reduced shard all-reduced across; both at dp's place in `order`, shard
    inside (layout/mesh.py SUB_DIMS). 1: one flat dp dim."""
    compile: bool = False
    """Each transformer block's forward through torch.compile (per block, as torchtitan does:
    engines/parallel/compile.py), every hook and collective around the blocks kept outside the graphs.
    The theory prices the layout as eager (its activation bytes are eager PyTorch's)."""

    def __post_init__(self):
        if isinstance(self.stage_layers, list):  # from a plain dict (JSON): the config stays hashable
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        check_fields(self)  # a wrong type or range is refused here, named, with a fix

    # -- the choices decoded once (labkit/config/choices.py): the code reads these, never the names
    @property
    def sharded(self) -> Sharded:
        """What `sharding` shards: .stage (ZeRO's 0-3), .optimizer, .grads, .params, .fsdp (FSDP's units)."""
        return choices.sharded(self.sharding)

    @property
    def reshards(self) -> bool:
        """Gathered parameters freed after each unit's forward and gathered again for its backward:
        ZeRO-3 always, FSDP as reshard_after_forward says; False where parameters are not sharded."""
        return self.sharded.params and (self.reshard_after_forward or not self.sharded.fsdp)

    @property
    def pipeline(self) -> PipelineShape:
        """What `schedule` does: .forwards_first, .one_f_one_b, .interleaved, .v_shaped, .splits_backward."""
        return choices.pipeline_shape(self.schedule)

    @property
    def torch_impl(self) -> bool:
        """impl='torch': PyTorch's own DDP, FSDP2, DTensor and pipelining run, not labkit's."""
        return choices.torch_impl(self.impl)

    @property
    def numerics(self) -> Numerics:
        """What `precision` computes in: .mixed (low-precision compute, fp32 masters), .fp8 (fp8 matmuls)."""
        return choices.numerics(self.precision)

    @property
    def fp8_scaling(self) -> Float8Scaling:
        """What `fp8_recipe` scales by: .rowwise, .gathers_fp8 (FSDP's float8 all-gather), .not_built."""
        return float8_scaling(self.fp8_recipe)

    @property
    def recomputation(self) -> Recomputation:
        """What checkpoint_activations rebuilds: .recomputes, .reruns_forward, .attention_only, .per_op."""
        return choices.recomputation(self.checkpoint_activations)

    @property
    def context(self) -> ContextComm:
        """What `cp_kind` moves: .ring (K/V hops), .gathers (K/V all-gathered), .splits_heads (Ulysses'
        all-to-all), .hierarchical (both: the all-to-all inside cp_a2a ranks, the ring across)."""
        return choices.context_comm(self.cp_kind)

    @property
    def recompute(self) -> Recompute:
        """'none', 'full', 'selective' or 'op': checkpoint_activations by name (True is 'full')."""
        return self.recomputation.mode

    @property
    def world(self) -> int:
        """Ranks this layout uses: dp * tp * pp * cp * ep."""
        return self.dp * self.tp * self.pp * self.cp * self.ep

    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}
