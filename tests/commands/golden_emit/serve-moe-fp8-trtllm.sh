#!/usr/bin/env bash
# modelcarve --emit-launch trtllm: PP2-DP4 wfp8/kvfp8, rank 1 for qwen3-30b-a3b on 1x8xH100
# mapping: TensorRT-LLM 1.2.1 (engines/trtllm.json; checked against trtllm-serve options of TensorRT-LLM 1.x (--tp_size, --pp_size, --ep_size, --max_batch_size, --max_seq_len, --extra_llm_api_options YAML with enable_attention_dp and kv_cache_config.dtype); not installable on this CPU machine)
# layout: PP2-DP4 tp=1 pp=2 dp=4 cp=1 ep=1 seq=2304 max_batch=1024
# weights: fp8 (a ModelOpt FP8 checkpoint)
# one trtllm-serve per data-parallel replica (plain DP without attention DP): 4 replicas, ports 8000..8003
CUDA_VISIBLE_DEVICES=0,1 trtllm-serve Qwen/Qwen3-30B-A3B \
  --backend pytorch \
  --tp_size 1 \
  --pp_size 2 \
  --max_seq_len 2304 \
  --max_batch_size 1024 \
  --extra_llm_api_options extra_llm_api_options.yaml \
  --port 8000 &
CUDA_VISIBLE_DEVICES=2,3 trtllm-serve Qwen/Qwen3-30B-A3B \
  --backend pytorch \
  --tp_size 1 \
  --pp_size 2 \
  --max_seq_len 2304 \
  --max_batch_size 1024 \
  --extra_llm_api_options extra_llm_api_options.yaml \
  --port 8001 &
CUDA_VISIBLE_DEVICES=4,5 trtllm-serve Qwen/Qwen3-30B-A3B \
  --backend pytorch \
  --tp_size 1 \
  --pp_size 2 \
  --max_seq_len 2304 \
  --max_batch_size 1024 \
  --extra_llm_api_options extra_llm_api_options.yaml \
  --port 8002 &
CUDA_VISIBLE_DEVICES=6,7 trtllm-serve Qwen/Qwen3-30B-A3B \
  --backend pytorch \
  --tp_size 1 \
  --pp_size 2 \
  --max_seq_len 2304 \
  --max_batch_size 1024 \
  --extra_llm_api_options extra_llm_api_options.yaml \
  --port 8003 &
wait
