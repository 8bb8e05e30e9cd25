#!/usr/bin/env bash
# The backward's registry entries for this machine's GPU: `attngen tune --kernel bwd` for dense,
# causal, a sliding window of 512 and causal documents' stand-in (chunked causal: a mask without
# tensors), bf16, D 128, S 4096, one call on one GPU (about 7 minutes on an H200), from the
# repository root. Writes the winners into tuned/<gpu>.yaml (copied to OUT_DIR, to commit) and the
# tuner's logs into OUT_DIR. How the bwd entries of tuned/h200.yaml were made.
# Usage: bash benchmarks/tune_bwd.sh OUT_DIR [TRIALS]
set -uo pipefail
out=${1:?usage: tune_bwd.sh OUT_DIR [TRIALS]}
trials=${2:-16}
source "$(dirname "$0")/steps.sh"
start "$out"
export ATTNGEN_REGISTRY=$PWD/tuned
for mask in none causal "sliding_window(window=512)" "chunked(chunk=512) & causal"; do
  name=$(echo "$mask" | tr -cd 'a-z_')
  step "tune_$name" 100 $py -m attngen tune --kernel bwd --mask "$mask" --dtype bf16 --head-dim 128 --seq-len 4096 \
    --trials "$trials" --timeout 80 --jobs 8 --compile-timeout 60 --storage /tmp/tune_bwd.journal --out tuned
done
cp tuned/*.yaml "$out/"
for f in "$out"/tune_*.txt; do tail -n 6 "$f"; done
