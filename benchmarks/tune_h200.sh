#!/usr/bin/env bash
# How tuned/h200.yaml was made: on a machine with 4 GPUs, in one call (about 8 minutes):
#   GPU 0: attngen tune, dense;  GPU 1: attngen tune, causal  (bf16 and fp16, D 64 and 128, S 1024 4096 16384)
#   GPU 2: the test suite on the GPU;  GPU 3: the exhaustive sweep for benchmarks/search_efficiency.py
# Usage: bash benchmarks/tune_h200.sh OUT_DIR [TRIALS]
set -uo pipefail
out=${1:?usage: tune_h200.sh OUT_DIR [TRIALS]}
trials=${2:-16}
mkdir -p "$out" /tmp/tuned
export PYTHONUNBUFFERED=1
matrix=(--dtype bf16,fp16 --head-dim 64,128 --seq-len 1024,4096,16384 --trials "$trials" --timeout 40 --jobs 8
        --compile-timeout 120 --out /tmp/tuned)
for i in 0 1; do
  mask=$([ $i = 0 ] && echo none || echo causal)
  CUDA_VISIBLE_DEVICES=$i python3 -m attngen tune --mask $mask "${matrix[@]}" --storage /tmp/tune_$mask.journal \
    > "$out/tune_$mask.log" 2>&1 &
done
(cd tests && CUDA_VISIBLE_DEVICES=2 python3 -m pytest -q -n 8 -p no:cacheprovider --rootdir=.. -c ../pyproject.toml \
   test_masks.py test_forward.py test_errors.py test_gpu.py test_templates.py test_tune.py -k "not killed and not writes_a_registry" \
   > "$out/tests_gpu.log" 2>&1; echo "tests exit $?" >> "$out/tests_gpu.log") &
(export CUDA_VISIBLE_DEVICES=3
 python3 -m attngen tune --mask causal --dtype bf16 --head-dim 128 --seq-len 4096 --space forward_small \
   --sampler grid --trials 1000 --jobs 8 --storage /tmp/grid.journal --out /tmp/grid_reg > "$out/efficiency.log" 2>&1
 python3 benchmarks/search_efficiency.py --storage /tmp/grid.journal --out /tmp/eff >> "$out/efficiency.log" 2>&1
 cp /tmp/grid.journal "$out/grid.journal") &
wait
cp /tmp/tuned/h200.yaml "$out/h200.yaml"
tail -n 30 "$out/tests_gpu.log" | grep -E "passed|failed|error" ; tail -n 8 "$out/efficiency.log"
tail -n 16 "$out/tune_none.log"; tail -n 16 "$out/tune_causal.log"
