#!/usr/bin/env bash
# The showcase `make demo` runs: the catalogue, a plan for a real model, a small CPU run.
set -euo pipefail
MC=".venv/bin/modelcarve"
echo "== modelcarve models"
$MC models
echo
echo "== modelcarve models show kimi-k2"
$MC models show kimi-k2
