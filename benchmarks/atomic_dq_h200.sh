#!/usr/bin/env bash
# deterministic=False's dQ by one bulk reduction through a tensor descriptor (commit df6cd0d), on
# one H100 or H200 in one go (at most 8 min of steps), from the repository root with attngen
# importable (PYTHONPATH=$PWD). Into OUT_DIR:
#   tests.txt       the backward's descriptor and atomic-dQ tests compiled (the bulk reduction
#                   against the pointer path), and the any_tile premise at D 256
#   atomic.txt      forward+backward with deterministic=False at configs with and without tensor
#                   descriptors (the `t` configs take the bulk reduction; the others add dQ by
#                   vector reductions), dense, causal and a sliding window
#   deterministic.txt  the same masks at the deterministic default 64x128 w8 s3 and the masks'
#                   64x64 w4 s2, in the same run
#   training.{txt,json}  dense and causal against SDPA cuDNN and FlexAttention
#   topk_masks.txt  top-k 64 with a sliding window and with documents at the masks' fallback 64x64 w4
#                   s2 against 64x128 w8 s3 (which a masked top-k call's backward should take)
# Usage: bash benchmarks/atomic_dq_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: atomic_dq_h200.sh OUT_DIR}
source "$(dirname "$0")/steps.sh"
start "$out"

step tests 150 bash -c "cd tests && $py -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir=.. -c ../pyproject.toml \
  -n 4 kernels/test_backward.py kernels/test_gpu.py -k '(tma or atomic or any_tile) and not compile'"
step atomic 100 $py benchmarks/bwd_configs.py --masks none,causal,window512 --nondeterministic \
  --configs 64x128x8x3,64x128x8x3t,64x128x8x2t,64x64x4x2t,128x128x8x1t
step deterministic 60 $py benchmarks/bwd_configs.py --masks none,causal,window512 --configs 64x128x8x3,64x64x4x2
step training 110 $py benchmarks/training.py --cases none,causal --methods attngen,cudnn,flex --profile --out "$out"
step topk_masks 60 $py benchmarks/bwd_configs.py --masks window512+topk64,document+topk64 \
  --configs 64x64x4x2,64x128x8x3
tail -n 3 "$out/tests.txt"
tail -n 17 "$out/atomic.txt"
tail -n 8 "$out/deterministic.txt"
tail -n 12 "$out/training.txt"
tail -n 6 "$out/topk_masks.txt"
