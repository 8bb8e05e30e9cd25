#!/usr/bin/env bash
# Issue 23's GPU checks and figures on one H200, in one go (at most 8 minutes 50 s of steps), from the repository
# root with attngen importable (PYTHONPATH=$PWD). Everything goes into OUT_DIR:
#   tests.txt           the backward's tests on the GPU (kernels/test_backward.py, not gpu-marked)
#   tests_gpu_marked.txt  its gpu-marked tests: a model shape in bf16 and fp16 for seven masks,
#                       deterministic=False, dropout, top-k, D 200 and 256
#   training.{txt,json} forward+backward of every case against SDPA cuDNN/flash, FlexAttention and
#                       torch, with each kernel's GPU time (benchmarks/training.py --profile)
#   varlen.{txt,json}   attngen.varlen_attention (both backward paths) against FA2's varlen and Flex
#   bwd_tma.txt         the backward's configs with tensor-descriptor loads against the fallback
#   bwd_atomic.txt      the backward's configs with deterministic=False (benchmarks/bwd_configs.py)
# Usage: bash benchmarks/training_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: training_h200.sh OUT_DIR}
source "$(dirname "$0")/steps.sh"
start "$out"

backward_tests
step training 150 $py benchmarks/training.py --cases none,causal,window512,document,dropout --profile --out "$out"
step varlen 60 $py benchmarks/varlen.py --out "$out"
step bwd_tma 60 $py benchmarks/bwd_configs.py --masks none,causal,window512 \
  --configs 64x64x4x2,64x64x4x2t,64x128x8x3t,64x128x8x2t
step bwd_atomic 50 $py benchmarks/bwd_configs.py --masks none,causal --nondeterministic \
  --configs 64x64x4x2,64x128x8x3,64x128x8x2,64x64x4x2t
tail -n 3 "$out/tests.txt" "$out/tests_gpu_marked.txt"
tail -n 30 "$out/training.txt"
grep -A 6 "^method" "$out/varlen.txt"
tail -n 14 "$out/bwd_tma.txt"
tail -n 10 "$out/bwd_atomic.txt"
