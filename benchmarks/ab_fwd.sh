#!/usr/bin/env bash
# A/B of two trees' dense forward on one GPU in one device call (about a minute of steps), from the
# repository root: this tree (A) and OLD_TREE (B, e.g. `git archive REV | tar -x -C ab/old`, left
# untracked so that the device call carries it). benchmarks/fwd_configs.py on the dense case at the
# sm90 fallback (128x64 w4 s2 TMA), in the order A B B A, each tree importing its own attngen. Into
# OUT_DIR: a.1.txt, b.1.txt, b.2.txt, a.2.txt.
# Usage: bash benchmarks/ab_fwd.sh OUT_DIR OLD_TREE
set -uo pipefail
source "$(dirname "$0")/steps.sh"
ab_start "${1:?usage: ab_fwd.sh OUT_DIR OLD_TREE}" "${2:?usage: ab_fwd.sh OUT_DIR OLD_TREE}"

for round in "$new a.1" "$old b.1" "$old b.2" "$new a.2"; do
  set -- $round
  step "$2" 60 env PYTHONPATH="$1:${PYTHONPATH:-}" $py "$1/benchmarks/fwd_configs.py" --masks none --configs 128x64x4x2t
done
for f in a.1 b.1 b.2 a.2; do echo "== $f"; grep -h '^| [a-z]' "$out/$f.txt" | grep -v '^| mask'; done
