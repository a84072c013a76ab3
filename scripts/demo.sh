#!/usr/bin/env bash
# The showcase `make demo` runs: the catalogue, plans for real models, a small split run on CPU.
set -euo pipefail
MC=".venv/bin/modelcarve"
export OMP_NUM_THREADS=1 COLUMNS=${COLUMNS:-180}
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "modelcarve models"
$MC models

step "Training Llama-3.1-70B on 8 nodes of 8 H100: the 5 fastest layouts, and why the others lost"
$MC plan --goal train --model llama-3.1-70b --cluster 8x8xH100 --global-batch 512 --seq 4096 --top 5

step "Serving Qwen3-32B interactively on 2 H100s (2048 tokens in, 256 out)"
$MC plan --goal serve-latency --model qwen3-32b --cluster 2xH100 --input-len 2048 --output-len 256 --top 3

step "Run a split model for real: tiny-llama, TP2 x PP2 on 4 CPU processes (gloo), 30 steps on the synthetic language (the loss falls)"
$MC run --model tiny-llama --layout "tp=2,pp=2,gbs=4,seq=64" --steps 30

step "Verify it: the same layout against the single-device reference on the same weights and data"
$MC verify --model tiny-llama --layout "tp=2,pp=2,gbs=4,seq=64,param_dtype=fp32" --steps 3
