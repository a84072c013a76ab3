#!/usr/bin/env bash
# modelcarve --emit-launch sglang: PP2-DP4 wfp8/kvfp8, rank 1 for qwen3-30b-a3b on 1x8xH100
# mapping: SGLang 0.5.23 (engines/sglang.json; checked against sglang python/sglang/srt/server_args.py (ServerArgs)
# layout: PP2-DP4 tp=1 pp=2 dp=4 cp=1 ep=1 seq=2304 max_batch=1024
python -m sglang.launch_server \
  --model-path Qwen/Qwen3-30B-A3B \
  --tp-size 1 \
  --pp-size 2 \
  --dp-size 4 \
  --dtype bfloat16 \
  --quantization fp8 \
  --kv-cache-dtype fp8_e4m3 \
  --context-length 2304 \
  --max-running-requests 1024
