#!/usr/bin/env bash
# modelcarve --emit-launch trtllm: TP2 wbf16/kvbf16, rank 1 for llama-3.1-8b on 1x2xH100
# mapping: TensorRT-LLM 1.2.1 (engines/trtllm.json; checked against trtllm-serve options of TensorRT-LLM 1.x (--tp_size, --pp_size, --ep_size, --max_batch_size, --max_seq_len, --extra_llm_api_options YAML with enable_attention_dp and kv_cache_config.dtype); not installable on this CPU machine)
# layout: TP2 tp=2 pp=1 dp=1 cp=1 ep=1 seq=2304 max_batch=1
trtllm-serve meta-llama/Llama-3.1-8B \
  --backend pytorch \
  --tp_size 2 \
  --pp_size 1 \
  --max_seq_len 2304 \
  --max_batch_size 1 \
  --extra_llm_api_options extra_llm_api_options.yaml
