# Sourced by the *_h200.sh scripts: `start OUT_DIR` makes the folder and records the GPU;
# `step NAME TIMEOUT_S COMMAND...` runs a command under a timeout, keeps its stdout and stderr in
# OUT_DIR/NAME.txt, and appends its exit status and seconds to OUT_DIR/times.txt. `backward_tests`: the
# steps tests and tests_gpu_marked, kernels/test_backward.py on the GPU. `ab_start OUT_DIR OLD_TREE`
# (the ab_*.sh scripts): start OUT_DIR, and set `new` (this tree) and `old` (absolute paths).
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

start() {
  out=$1
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
}

step() {
  local name=$1 limit=$2 begin=$SECONDS
  shift 2
  echo "== $(date +%T) $name: $*" | tee -a "$out/times.txt"
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "   $name: exit $?, $((SECONDS - begin)) s" | tee -a "$out/times.txt"
}

backward_tests() {
  # the gpu-marked tests on two workers: on eight, their float32 references at B=4 H=16 S=4096 ran an
  # 80 GB H100 out of memory (run 143)
  step tests 60 bash -c "cd tests && $py -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir=.. \
    -c ../pyproject.toml -n 16 -m 'not gpu' kernels/test_backward.py"
  step tests_gpu_marked 150 bash -c "cd tests && $py -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir=.. \
    -c ../pyproject.toml -n 2 -m gpu kernels/test_backward.py"
}

ab_start() {
  old=$(cd "$2" && pwd) || exit 1
  new=$PWD
  start "$1"
}
