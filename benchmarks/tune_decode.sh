#!/usr/bin/env bash
# The decode family's registry entries for this machine's GPU: `attngen tune --kernel decode` at the
# three cases of benchmarks/decode.py (bf16, Hq 32, Hkv 8, D 128; B1 at 64k keys, B8 at 8k, B64 at
# 2k), then benchmarks/decode.py with the new entries, in one call (about 4 minutes on an H100),
# from the repository root. Writes the winners into tuned/<gpu>.yaml (copied to OUT_DIR, to commit)
# and the tuner's logs and decode.{txt,json} into OUT_DIR. How tuned/h100.yaml was made.
# Usage: bash benchmarks/tune_decode.sh OUT_DIR [TRIALS]
set -uo pipefail
out=${1:?usage: tune_decode.sh OUT_DIR [TRIALS]}
trials=${2:-40}
source "$(dirname "$0")/steps.sh"
start "$out"
export ATTNGEN_REGISTRY=$PWD/tuned
for case in 1:65536 8:8192 64:2048; do
  batch=${case%%:*} len=${case##*:}
  step "tune_b$batch" 70 $py -m attngen tune --kernel decode --batch "$batch" --seq-len "$len" --heads 32 --kv-heads 8 \
    --dtype bf16 --head-dim 128 --trials "$trials" --timeout 45 --jobs 8 --compile-timeout 40 \
    --storage /tmp/tune_decode.journal --out tuned
done
cp tuned/*.yaml "$out/"
step decode 120 $py benchmarks/decode.py --out "$out"
for f in "$out"/tune_*.txt; do tail -n 4 "$f"; done
tail -n 36 "$out/decode.txt"
