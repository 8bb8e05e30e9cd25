#!/usr/bin/env bash
# Issue 23's performance goals measured in one device call (at most 9 minutes 40 s of steps) on one
# H100 or H200, from the repository root with attngen importable (PYTHONPATH=$PWD). Into OUT_DIR:
#   training.{txt,json}  forward+backward of every case at S=4096 (dense, causal, the four masks,
#                        top-k 64 and 256, dropout) against SDPA, FlexAttention and torch, with each
#                        kernel's GPU time (benchmarks/training.py --profile)
#   training_16k/        the same for dense and causal at S=16384
#   tests.txt            the any_tile premise (wgmma scores bit for bit the same at every tile and
#                        orientation), D 64 to 256
# Usage: bash benchmarks/goals_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: goals_h200.sh OUT_DIR}
source "$(dirname "$0")/steps.sh"
start "$out"

step training 260 $py benchmarks/training.py --profile --out "$out"
mkdir -p "$out/training_16k"
step training_16k 220 $py benchmarks/training.py --shape 4,16,16384,128 --cases none,causal \
  --methods attngen,cudnn,flex --profile --out "$out/training_16k"
step tests 100 bash -c "cd tests && $py -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir=.. -c ../pyproject.toml \
  -n 3 kernels/test_gpu.py -k any_tile"
tail -n 3 "$out/tests.txt"
tail -n 32 "$out/training.txt"
tail -n 10 "$out/training_16k.txt"
