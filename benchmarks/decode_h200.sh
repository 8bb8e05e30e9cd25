#!/usr/bin/env bash
# Issue 25's GPU checks and figures on one H200, in one go (under 9 minutes), from the repository
# root with attngen importable (PYTHONPATH=$PWD). Everything goes into OUT_DIR:
#   tests.txt        the GPU tests of decoding (bf16 at a model shape, a decode step captured in a CUDA
#                    graph and replayed on new tokens, lengths and block tables without recompiling),
#                    of the direct launch (kernels/test_direct_launch.py), the forward kernels'
#                    (kernels/test_gpu.py) and torch.compile / CUDA graphs (test_ops.py)
#   decode.{txt,json}     attngen.decode against SDPA flash/efficient, FlexAttention, with each
#                         kernel's GPU time (benchmarks/decode.py --profile)
#   host_time.{txt,json}  host time per call of attngen.attention and SDPA (benchmarks/host_time.py)
#   decode_configs.{txt,json}  the decode kernels' configs swept (benchmarks/decode_configs.py)
# Usage: bash benchmarks/decode_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: decode_h200.sh OUT_DIR}
source "$(dirname "$0")/steps.sh"
start "$out"

step tests 240 bash -c "cd tests && $py -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir=.. -c ../pyproject.toml \
  -n 8 kernels/test_decode.py kernels/test_direct_launch.py kernels/test_launch.py kernels/test_gpu.py test_ops.py"
step decode 240 $py benchmarks/decode.py --out "$out" --profile
step host_time 60 env OUT="$out" $py benchmarks/host_time.py
step decode_configs 150 $py benchmarks/decode_configs.py --out "$out" --budget 120
tail -n 3 "$out/tests.txt"
tail -n 36 "$out/decode.txt"
tail -n 15 "$out/host_time.txt"
tail -n 40 "$out/decode_configs.txt"
