#!/usr/bin/env bash
# Issue 26's GPU checks, and the re-timing of the forward and backward after commit f30a22f (NaN and
# inf as the reference has them: a per-row select in the softmax step, a new tanh for softcap), on
# one H200 in one go (under 9 minutes), from the repository root with attngen importable
# (PYTHONPATH=$PWD). Everything goes into OUT_DIR:
#   tests.txt        8 threads x mixed shapes/dtypes/masks equal to single-threaded results (compiled
#                    kernels), device memory bounded under ever new shapes, the fuzz test on CUDA
#   forward.{md,json}     benchmarks/forward.py, bf16, the tuned registry (the "Forward through the
#                         dispatcher" table of RESULTS.md)
#   training.{md,json}    benchmarks/training.py, bf16 B4 H16 S4096 D128: none, causal, window512,
#                         document, dropout (the forward + backward table)
# Usage: bash benchmarks/reliability_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: reliability_h200.sh OUT_DIR}
source "$(dirname "$0")/steps.sh"
start "$out"

step tests 200 bash -c "cd tests && $py -m pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml -n 3 \
  test_concurrency.py test_caches.py test_fuzz.py kernels/test_nonfinite.py"
step forward 120 env ATTNGEN_REGISTRY=tuned $py benchmarks/forward.py --out "$out" --dtypes bf16
step training 200 $py benchmarks/training.py --out "$out" --cases none,causal,window512,document,dropout --profile
tail -n 3 "$out/tests.txt"
tail -n 16 "$out/forward.txt"
tail -n 20 "$out/training.txt"
