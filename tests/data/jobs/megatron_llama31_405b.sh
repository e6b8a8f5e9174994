#!/bin/bash
# Llama 3.1 405B pretraining on 1024 H100s, as NVIDIA's Megatron-Bridge performance recipe runs it,
# written as the Megatron-LM (core_v0.14.0) pretrain_gpt.py launch it amounts to (see README.md):
#   Megatron-Bridge src/megatron/bridge/recipes/llama/llama31_perf.py @ be7c542d,
#     llama31_405b_pretrain_1024gpu_h100_bf16_config: TP 8, PP 8, CP 2, VPP 8, SP, GBS 512, MBS 1,
#     seq 8192, vocab 128256 (padded), bf16
#   over src/megatron/bridge/recipes/llama/llama31_405b.py @ 3594df94 (embedding and loss counted in
#     the pipeline split, the distributed optimizer) and Llama31ModelProvider405B (the architecture).
NNODES=128
GPUS_PER_NODE=8
TP=8
PP=8
CP=2
VPP=8

torchrun --nnodes $NNODES --nproc-per-node $GPUS_PER_NODE --node-rank $NODE_RANK \
    --master-addr $MASTER_ADDR --master-port 6000 \
    pretrain_gpt.py \
    --tensor-model-parallel-size $TP \
    --pipeline-model-parallel-size $PP \
    --context-parallel-size $CP \
    --num-virtual-stages-per-pipeline-rank $VPP \
    --account-for-embedding-in-pipeline-split \
    --account-for-loss-in-pipeline-split \
    --sequence-parallel \
    --use-distributed-optimizer \
    --overlap-grad-reduce \
    --overlap-param-gather \
    --tp-comm-overlap \
    --num-layers 126 \
    --hidden-size 16384 \
    --ffn-hidden-size 53248 \
    --num-attention-heads 128 \
    --group-query-attention \
    --num-query-groups 8 \
    --seq-length 8192 \
    --max-position-embeddings 131072 \
    --position-embedding-type rope \
    --rotary-base 500000 \
    --use-rope-scaling \
    --rope-scaling-factor 8.0 \
    --normalization RMSNorm \
    --norm-epsilon 1e-5 \
    --swiglu \
    --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --tokenizer-type NullTokenizer \
    --vocab-size 128256 \
    --make-vocab-size-divisible-by 128 \
    --micro-batch-size 1 \
    --global-batch-size 512 \
    --bf16 \
    --lr 3e-4 \
    --min-lr 3e-5 \
    --lr-warmup-iters 2000 \
    --lr-decay-style cosine \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --weight-decay 0.1 \
    --clip-grad 1.0 \
    --train-iters 1168251 \
    --mock-data
