#!/usr/bin/env bash
# Issue 24's GPU checks and figures on one H200, in one go, from the repository root with attngen
# importable (PYTHONPATH=$PWD, transformers on the path). Everything goes into OUT_DIR:
#   tests.txt      the integration tests on the GPU: torch.compile/export/CUDA graphs (tests/test_ops.py),
#                  the SDPA drop-in, varlen, Hugging Face transformers (bf16 gpu test included)
#   varlen.{txt,json}    attngen.varlen_attention against FA2's varlen and FlexAttention (benchmarks/varlen.py)
#   hf_models.{txt,json} tokens/s of Llama-1B and a Gemma-2-2B shape under attngen, sdpa, flex_attention
# Usage: bash benchmarks/integrations_h200.sh OUT_DIR
set -uo pipefail
out=${1:?usage: integrations_h200.sh OUT_DIR}
source "$(dirname "$0")/steps.sh"
start "$out"

step tests 240 bash -c "cd tests && $py -m pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml -n 3 \
  test_ops.py test_sdpa.py test_varlen.py integrations"
step varlen 200 $py benchmarks/varlen.py --out "$out" --profile
step hf_models 400 $py benchmarks/hf_models.py --out "$out/hf_models.json"
tail -n 3 "$out/tests.txt"
grep -A 4 "^method" "$out/varlen.txt"
tail -n 12 "$out/hf_models.txt"
