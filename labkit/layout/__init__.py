"""The layout: the decisions the executor (labkit.engines), the simulator and the theory
(labkit.theory) share, as plain data. Torch-free (the standard library, numpy and
labkit.config only); the engines and the theory both import it and never each other.

    mesh        the rank grid of an order string, every group of every (combined) dim
    schedules   pipeline schedules as per-rank action lists; simulator runs them on paper
    tensor      the tensor-parallel styles: module name -> style
    buckets     gradient buckets (labkit's DDP and ZeRO-1/2, PyTorch's DDP)
    flat        flat buffers of ZeRO / FSDP and their shards
    wire        the ring model's bytes per collective
    precision   bytes per element
    text        the text corpus (package data), its byte tokenizer, the train / validation split
                and the windows each step reads (shared by the engines, the reference, the notebook)
"""
