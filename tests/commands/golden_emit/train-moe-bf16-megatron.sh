#!/usr/bin/env bash
# modelcarve --emit-launch megatron: PP2v6-DP8-Z1-EP8, rank 1 for qwen3-30b-a3b on 2x8xH100
# mapping: Megatron-LM core_v0.19.2 (engines/megatron.json; checked against Megatron-LM megatron/training/arguments.py (megatron-core 0.19.2))
# layout: PP2v6-DP8-Z1-EP8 tp=1 pp=2 dp=8 cp=1 ep=8 seq=4096
torchrun \
  --nnodes 2 \
  --nproc-per-node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 1 \
  --pipeline-model-parallel-size 2 \
  --context-parallel-size 1 \
  --expert-model-parallel-size 8 \
  --expert-tensor-parallel-size 1 \
  --use-distributed-optimizer \
  --num-distributed-optimizer-instances 1 \
  --micro-batch-size 1 \
  --global-batch-size 512 \
  --seq-length 4096 \
  --bf16 \
  --overlap-grad-reduce \
  --overlap-param-gather \
  --pipeline-model-parallel-layout 'Et*4|t*4|t*4|t*4|t*4|t*4|t*4|t*4|t*4|t*4|t*4|t*4L'
