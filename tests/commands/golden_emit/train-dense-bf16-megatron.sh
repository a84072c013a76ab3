#!/usr/bin/env bash
# modelcarve --emit-launch megatron: DP8-Z2, rank 1 for llama-3.1-8b on 1x8xH100
# mapping: Megatron-LM core_v0.19.2 (engines/megatron.json; checked against Megatron-LM megatron/training/arguments.py (megatron-core 0.19.2))
# layout: DP8-Z2 tp=1 pp=1 dp=8 cp=1 ep=1 seq=4096
torchrun \
  --nnodes 1 \
  --nproc-per-node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 1 \
  --pipeline-model-parallel-size 1 \
  --context-parallel-size 1 \
  --use-distributed-optimizer \
  --use-megatron-fsdp \
  --data-parallel-sharding-strategy optim_grads \
  --micro-batch-size 2 \
  --global-batch-size 256 \
  --seq-length 4096 \
  --bf16 \
  --overlap-grad-reduce \
  --overlap-param-gather
