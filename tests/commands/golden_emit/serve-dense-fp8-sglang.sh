#!/usr/bin/env bash
# modelcarve --emit-launch sglang: TP2 wfp8/kvfp8, rank 1 for qwen3-32b on 1x2xH100
# mapping: SGLang 0.5.23 (engines/sglang.json; checked against sglang python/sglang/srt/server_args.py (ServerArgs)
# layout: TP2 tp=2 pp=1 dp=1 cp=1 ep=1 seq=2304 max_batch=1
python -m sglang.launch_server \
  --model-path Qwen/Qwen3-32B \
  --tp-size 2 \
  --pp-size 1 \
  --dp-size 1 \
  --dtype bfloat16 \
  --quantization fp8 \
  --kv-cache-dtype fp8_e4m3 \
  --context-length 2304 \
  --max-running-requests 1
