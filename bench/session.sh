#!/usr/bin/env bash
# One device call's worth of GPU measurements, in priority order, each bounded so the call ends inside 600 s.
# Usage on the device (after ../shared/tools/device-prep here; carry .whl and .data):
#   bash bench/session.sh [parity|vit|e2e|all]
# Full logs land in $OUT (when set); the tail of each step is the table to copy into bench/RESULTS.md.
set -u
what=${1:-all}
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
case $what in parity|all)
  timeout 150 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep '^|' ;; esac
case $what in vit|all)
  # default compile mode: max-autotune spent 133 s compiling one 6B bucket in an earlier run
  timeout 280 python3 bench/vit.py --batches 16,64,128 --mode default --hf-mode default --budget-s 240 \
    2>&1 | tee "$out/vit.log" | grep -E 'tiles/s|floor|compile' | tail -30 ;; esac
case $what in e2e|all)
  timeout 420 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,cache,nocache+cllm+overlap,hf \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|greedy|^\||ceiling' ;; esac
