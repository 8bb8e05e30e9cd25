#!/usr/bin/env bash
# How tuned/h200.yaml and the figures in benchmarks/RESULTS.md were made: one call on a machine
# with 4 H200s (about 8 minutes), from the repository root.
#   GPU 0 / 1: attngen tune, dense / causal (bf16 and fp16, D 64 and 128, S 1024 4096 16384) into tuned/,
#              then benchmarks/forward.py through the dispatcher with that registry (bf16 / fp16)
#   GPU 2: the exhaustive sweep of search_spaces/forward_small.yaml and benchmarks/search_efficiency.py
#   GPU 3: benchmarks/overhead.py
# Usage: bash benchmarks/tune_h200.sh OUT_DIR [TRIALS]
set -uo pipefail
out=${1:?usage: tune_h200.sh OUT_DIR [TRIALS]}
trials=${2:-16}
mkdir -p "$out/bench"
export PYTHONUNBUFFERED=1 ATTNGEN_REGISTRY=$PWD/tuned
matrix=(--dtype bf16,fp16 --head-dim 64,128 --seq-len 1024,4096,16384 --trials "$trials" --timeout 25 --jobs 8
        --compile-timeout 120 --out tuned)
for i in 0 1; do
  mask=$([ $i = 0 ] && echo none || echo causal)
  dtype=$([ $i = 0 ] && echo bf16 || echo fp16)
  (export CUDA_VISIBLE_DEVICES=$i
   timeout 330 python3 -m attngen tune --mask $mask "${matrix[@]}" --storage /tmp/tune_$mask.journal \
     > /tmp/tune_$mask.log 2>&1
   echo "tune $mask exit $?" >> /tmp/tune_$mask.log
   touch /tmp/tuned_$i
   while [ ! -e /tmp/tuned_0 ] || [ ! -e /tmp/tuned_1 ]; do sleep 2; done   # benchmark with both masks tuned
   timeout 150 python3 benchmarks/forward.py --dtypes $dtype --masks none,causal --seq-lens 1024,4096,16384 \
     --out "$out/bench" --tag _sweep_$dtype > /tmp/bench_sweep_$dtype.log 2>&1
   timeout 80 python3 benchmarks/forward.py --dtypes $dtype --masks sliding_window,document \
     --out "$out/bench" --tag _masks_$dtype > /tmp/bench_masks_$dtype.log 2>&1
   rm -f "$out"/bench/*.md) &
done
(export CUDA_VISIBLE_DEVICES=2
 timeout 400 python3 -m attngen tune --mask causal --dtype bf16 --head-dim 128 --seq-len 4096 --space forward_small \
   --sampler grid --trials 1000 --jobs 8 --storage /tmp/grid.journal --out /tmp/grid_reg > "$out/efficiency.log" 2>&1
 python3 benchmarks/search_efficiency.py --storage /tmp/grid.journal --out /tmp/eff >> "$out/efficiency.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=3 timeout 300 python3 benchmarks/overhead.py --out /tmp/overhead > /tmp/overhead.log 2>&1
 cp /tmp/overhead/overhead.md "$out/overhead.md") &
wait
cat /tmp/tune_none.log /tmp/tune_causal.log /tmp/bench_*.log > "$out/tune.log"
cp tuned/h200.yaml "$out/h200.yaml"
tail -n 9 "$out/efficiency.log"; cat "$out/overhead.md"
grep -hE "^(none|causal)|exit" /tmp/tune_none.log /tmp/tune_causal.log
grep -h "^|" /tmp/bench_*.log
