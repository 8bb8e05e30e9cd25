#!/usr/bin/env bash
# A/B of two trees' backward kernels on one GPU in one device call (at most 9 minutes of steps), from
# the repository root: this tree (A) and OLD_TREE (B, e.g. `git archive REV | tar -x -C ab/old`, left
# untracked so that the device call carries it). benchmarks/bwd_configs.py at each case's sm90
# fallback (dense and causal 64x128 w8 s3; the masks 64x64 w4 s2), in the order A B B A so that
# drift between the rounds shows, each tree importing its own attngen. Into OUT_DIR: a.1.txt,
# b.1.txt, b.2.txt, a.2.txt (dense, causal) and the same with `masks` (window 512, document,
# prefix 1024, block-sparse 10%).
# Usage: bash benchmarks/ab_bwd.sh OUT_DIR OLD_TREE
set -uo pipefail
source "$(dirname "$0")/steps.sh"
ab_start "${1:?usage: ab_bwd.sh OUT_DIR OLD_TREE}" "${2:?usage: ab_bwd.sh OUT_DIR OLD_TREE}"

run() {  # TREE LABEL: both cases of one tree
  local tree=$1 label=$2
  step "$label" 60 env PYTHONPATH="$tree:${PYTHONPATH:-}" $py "$tree/benchmarks/bwd_configs.py" --masks none,causal \
    --configs 64x128x8x3
  step "masks.$label" 70 env PYTHONPATH="$tree:${PYTHONPATH:-}" $py "$tree/benchmarks/bwd_configs.py" \
    --masks window512,document,prefix1024,sparse10 --configs 64x64x4x2
}
run "$new" a.1
run "$old" b.1
run "$old" b.2
run "$new" a.2
for f in a.1 b.1 b.2 a.2; do echo "== $f"; grep -h '^| [a-z]' "$out/$f.txt" "$out/masks.$f.txt" | grep -v '^| mask'; done
