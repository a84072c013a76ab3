#!/usr/bin/env bash
# modelcarve --emit-launch sglang: TP2 wbf16/kvbf16, rank 1 for llama-3.1-8b on 1x2xH100
# mapping: SGLang 0.5.23 (engines/sglang.json; checked against sglang python/sglang/srt/server_args.py (ServerArgs)
# layout: TP2 tp=2 pp=1 dp=1 cp=1 ep=1 seq=2304 max_batch=1
python -m sglang.launch_server \
  --model-path meta-llama/Llama-3.1-8B \
  --tp-size 2 \
  --pp-size 1 \
  --dp-size 1 \
  --dtype bfloat16 \
  --kv-cache-dtype auto \
  --context-length 2304 \
  --max-running-requests 1
