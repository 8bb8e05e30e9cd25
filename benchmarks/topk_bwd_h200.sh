#!/usr/bin/env bash
# The GPU checks and figures of the commits of 2026-12-07 (run 143 of docs/journal/backward.md: a top-k call's
# backward at its own config on Hopper, 1cdbcf7; dropout's bits and inline PTX, aa09095; the
# backward's paired row statistics, 850de6a), on one H100 or H200 in one go (at most 8 min 50 s
# of steps), from the repository root with attngen importable (PYTHONPATH=$PWD). Into OUT_DIR:
#   tests_gpu.txt  the GPU tests of the scores' bits at any tile and orientation (the premise of
#                  topk.any_tile) and of top-k
#   tests.txt, tests_gpu_marked.txt  the backward's tests: not gpu-marked, then gpu-marked
#   bwd_topk.txt   top-k K=64 and 256 forward+backward: the backward at the threshold kernels' tiles
#                  (the config `threshold`, the path before 1cdbcf7) against its own configs
#   training.{txt,json}  forward+backward of dense, causal, top-k 64 and dropout against SDPA cuDNN,
#                  FlexAttention and torch, with each kernel's GPU time
# Usage: bash benchmarks/topk_bwd_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: topk_bwd_h200.sh OUT_DIR}
source "$(dirname "$0")/steps.sh"
start "$out"

step tests_gpu 90 bash -c "cd tests && $py -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir=.. \
  -c ../pyproject.toml -n 8 kernels/test_gpu.py -k 'any_tile or topk'"
backward_tests
step bwd_topk 100 $py benchmarks/bwd_configs.py --masks topk64,topk256 \
  --configs threshold,64x128x8x3,64x128x8x3t,64x64x4x3,128x128x8x2
step training 130 $py benchmarks/training.py --cases none,causal,topk64,dropout --profile --out "$out"
tail -n 3 "$out/tests_gpu.txt" "$out/tests.txt" "$out/tests_gpu_marked.txt"
tail -n 12 "$out/bwd_topk.txt"
tail -n 24 "$out/training.txt"
