"""The oracle (orchestration, rung 3): the one-process reference, the assembly of every rank's shards
and replicas into whole tensors, the bounds of each precision, and the checks of a run against them."""
