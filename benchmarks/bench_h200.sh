#!/usr/bin/env bash
# `attngen bench` and `attngen profile` on one H200, in one go (3.5 minutes on 2026-11-29), from the repository
# root with attngen importable (installed, or PYTHONPATH=$PWD). Everything goes into OUT_DIR:
#   1. fwd.{txt,md,json}      forward, B=4 H=16 S=4096 D=128, fp16 and bf16, dense and causal, every method
#   2. sweep.{txt,md,json,png} forward, B=1 H=16 D=128, bf16, causal, S 1024..32768: time and peak memory
#                              against S (naive's quadratic memory against the fused kernels' linear one);
#                              B=1 so that the float64 reference and naive's (S, S) scores stay affordable
#   3. profile_{naive,attngen}.txt / .json   torch.profiler tables (and Chrome traces) at the default
#                              shape, bf16, causal, with the memory columns
#   4. bwd.{txt,md,json}      forward + backward, the same four cases as 1 (attngen: n/a until it has a
#                              backward kernel)
# Each bench run writes its files after every case, so a step cut short by its timeout keeps what it
# measured; times.txt says how long each step took.
# Usage: bash benchmarks/bench_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: bench_h200.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1

step() {  # step NAME TIMEOUT_S COMMAND...: run, keep stdout in NAME.txt and stderr in NAME.log, time it
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $(date +%T) $name: $*" | tee -a "$out/times.txt"
  timeout "$limit" "$@" > "$out/$name.txt" 2> "$out/$name.log"
  echo "   $name: exit $?, $((SECONDS - start)) s" | tee -a "$out/times.txt"
}

step fwd 150 $py -m attngen bench --dtype fp16,bf16 --mask none --mask causal \
  --markdown "$out/fwd.md" --json "$out/fwd.json"
step sweep 150 $py -m attngen bench --shape 1,16,4096,128 --seq-lens 1024,2048,4096,8192,16384,32768 --dtype bf16 \
  --mask causal --methods naive,sdpa_flash,sdpa_cudnn,flex,attngen \
  --markdown "$out/sweep.md" --json "$out/sweep.json" --plot "$out/sweep.png"
for method in naive attngen; do
  step "profile_$method" 40 $py -m attngen profile --method $method --dtype bf16 --mask causal --memory \
    --trace "$out/profile_$method.json"
done
step bwd 200 $py -m attngen bench --bwd --dtype fp16,bf16 --mask none --mask causal \
  --markdown "$out/bwd.md" --json "$out/bwd.json"
cat "$out/fwd.txt" "$out/sweep.txt" "$out/bwd.txt" "$out/times.txt"
