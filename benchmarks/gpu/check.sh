#!/usr/bin/env bash
# The stack on the lent GPU (issue [G]): run on the device machine, from the repository root,
# after the wheel pieces of ../shared/gpu/stage.sh were copied to /tmp/stage (see
# docs/gpu.md for the calls). Writes everything it measures under $OUT (or ./gpu-out).
#
#   benchmarks/gpu/check.sh install      unpack and install vLLM 0.26 under /tmp/site
#   benchmarks/gpu/check.sh trap_check   V2 refused by name; (a) the in-place trap, bf16 and fp32
#   benchmarks/gpu/check.sh suites envoys|runner   (b) the equivalence suites of [C] / [D]
#   benchmarks/gpu/check.sh bench SHAPE CONCURRENCY REPEATS   (c) throughput of the [F] arms, eager, graphs and ours
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
root=$(pwd)
export PYTHONPATH=/tmp/site:$root/packages/tokenspan/src:$root/packages/tpfragments/src:$root/packages/vllm-envoys/src:$root/packages/vllm-runner/src
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
python=python3

install() {
  (cd /tmp/stage && cat part* | (mkdir -p w && tar x -C w)) &&
    $python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/w/*.whl &&
    $python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
}

trap_check() {
  local status=0
  # The V2 runner (GPU default) is refused at start-up by name; V1 is chosen otherwise.
  VLLM_USE_V2_MODEL_RUNNER=1 $python -c "
from vllm_runner import LLM, UnsupportedEngine
try:
    LLM('unused')
except UnsupportedEngine as refused:
    print('V2 refused:', refused)
else:
    raise SystemExit('V2 was not refused')" 2>&1 | tail -2 | tee "$out/v2-refused.txt" || status=1
  for dtype in bfloat16 float32; do
    $python benchmarks/gpu/inplace_check.py --dtype "$dtype" --out "$out/inplace-$dtype.md" \
      > "$out/inplace-$dtype.log" 2>&1 || status=1
    grep -v WARNING "$out/inplace-$dtype.log" | tail -25
  done
  return $status
}

suites() {
  # (b) [C]'s suite with transformers on the same GPU (`suites envoys`), or [D]'s with its oracle
  # on the CPU (`suites runner`): each fits one 10-minute call. The tests that need the embedded
  # model or the CLI are left out; tensor parallelism runs where there are two GPUs.
  local which=${1:-envoys} report=(-q -p no:cacheprovider --tb=short -rfE)
  export TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-ieee
  if [ "$which" = envoys ]; then
    VLLM_INTERP_ORACLE_DEVICE=cuda $python -m pytest "${report[@]}" \
      packages/vllm-envoys/tests/test_equivalence.py packages/vllm-envoys/tests/test_values.py \
      > "$out/envoys-pytest.txt" 2>&1
  else
    local tp=--ignore=packages/vllm-runner/tests/test_tensor_parallel.py
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && tp=
    $python -m pytest "${report[@]}" packages/vllm-runner/tests $tp \
      --ignore=packages/vllm-runner/tests/test_embedded.py \
      --ignore=packages/vllm-runner/tests/test_cli.py \
      --ignore=packages/vllm-runner/tests/test_extract.py \
      --ignore=packages/vllm-runner/tests/test_guide.py > "$out/runner-pytest.txt" 2>&1
  fi
  local status=$?
  tail -40 "$out/$which-pytest.txt"
  return $status
}

bench() {
  # One concurrency level per call: at concurrency 1 the eager engines take ~15 s a run on the
  # H200 (one request at a time), so three levels do not fit one 10-minute call.
  local shape=${1:-smollm2-135m} concurrency=${2:-64} repeats=${3:-3}
  local name="bench-$shape-c${concurrency//,/-}"
  $python benchmarks/vllm_runner_bench.py --shape "$shape" --dtype bfloat16 --graphs \
    --concurrency "$concurrency" --min-requests 4 --repeats "$repeats" \
    --gpu-memory-utilization 0.25 --results "$out/$name.md" --plot "$out/$name.png" \
    > "$out/$name.log" 2>&1
  local status=$?
  grep -v WARNING "$out/$name.log" | grep -v "Capturing CUDA graphs" | tail -40
  return $status
}

"$@"
