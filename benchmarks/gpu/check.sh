#!/usr/bin/env bash
# The stack on the lent GPU (issue [G]): run on the device machine, from the repository root,
# after the wheel pieces of ../shared/gpu/stage.sh were copied to /tmp/stage (see
# docs/gpu.md for the calls). Writes everything it measures under $OUT (or ./gpu-out).
#
#   benchmarks/gpu/check.sh install      unpack and install the staged vLLM (0.33 or 0.34) under /tmp/site,
#                                         and our wheels if the call carried .gpu-wheels
#   benchmarks/gpu/check.sh trap_check   (a) the in-place trap, bf16 and fp32, bf16 with saves
#                                         moved to the host at every step, and bf16 compiled with
#                                         every value a tap (issue [K])
# The model runner is vLLM's choice (V2 on a GPU) unless the command sets
# VLLM_USE_V2_MODEL_RUNNER=0 (V1; issue [J]).
#   benchmarks/gpu/check.sh suites envoys|runner [PYTEST_ARGS...]   (b) the equivalence suites of
#                                         [C] / [D]; extra arguments (e.g. -k) go to pytest;
#                                         PARALLEL=n (both suites) runs n pytest-xdist workers
#                                         on one GPU (build-wheels.sh carries xdist there);
#                                         PARALLEL=family (envoys): one process per family,
#                                         all side by side (FAMILIES="a b" picks some);
#                                         the runner's whole suite took 340 s under V2 and
#                                         297 s under V1 with PARALLEL=5 (2026-12-02), over
#                                         1,130 s in one process; SHARD=i/n runs the i-th of n
#                                         slices of its files; VLLM_INTERP_SUITE_COMPILED=1 runs
#                                         the runner's compiled pass (as nox -s tests does)
#   benchmarks/gpu/check.sh families_compiled [CASE ...]   every envoys family compiled with
#                                         every value a tap against eager (issue [K]; PARALLEL=9)
#   benchmarks/gpu/check.sh record MODEL_DIR   real V2 steps recorded as a test fixture (issue [J])
#   benchmarks/gpu/check.sh bench SHAPE CONCURRENCY REPEATS   (c) throughput of the [F] arms, eager, graphs and ours
#   benchmarks/gpu/check.sh compiled SHAPE REPEATS [REQUESTS]   (d) issue [K]'s arms on a compiled
#                                         engine with taps, against vLLM's default engine (each in
#                                         its own process); REQUESTS per run (256; 64 = one wave:
#                                         short pairs, many repeats, less of the host's noise)
#   benchmarks/gpu/check.sh sae [REPEATS]   (e) the SAE ops ([P]) at the Llama-3.1-8B shape against
#                                         vLLM's default engine (ARMS= picks of a,sf,sf32,ss,sc)
#   benchmarks/gpu/check.sh headline SHAPE   (f) docs/benchmarks.md's headline table at SHAPE
#                                         ([T]; ARMS=, NO_TWIN=1, PART=, REPEATS=, COMMIT=)
#   benchmarks/gpu/check.sh COMMAND ...  any command in this environment (e.g. the bench's --profile)
# Run benchmarks one at a time: beside a second one on the other GPU the bare engine was 1.6x
# slower (host work of two processes), and arms whose cost is host work more so.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
root=$(pwd)
# CuTe DSL (vLLM 0.34) puts its `cutlass` package on the path with a .pth file, which Python reads
# only in site-packages, not in a PYTHONPATH folder: its folder is named here instead.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$root/packages/tokenspan/src:$root/packages/tpfragments/src:$root/packages/vllm-envoys/src:$root/packages/vllm-runner/src:$root/packages/saecodec/src
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
# Where the staged CuTe DSL lacks its `cutlass` package, vLLM 0.34's MiniMax-M3 warmup (a no-op
# for other models) is stubbed: no_cutedsl/sitecustomize.py says why.
if [ -d /tmp/site/nvidia_cutlass_dsl ] && [ ! -f /tmp/site/nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py ]; then
  export PYTHONPATH=$root/benchmarks/gpu/no_cutedsl:$PYTHONPATH
fi
# vLLM 0.33's torch wants cuDNN 9.24, the image has 9.19 (../shared/gpu/README.md); no hub here.
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
python=python3

install() {
  (cd /tmp/stage && cat part* | (mkdir -p w && tar x -C w)) &&
    # vLLM 0.34's extra wheels (benchmarks/gpu/stage-0.34-extra.sh), a tar of their own.
    (cd /tmp/stage && if ls xpart* > /dev/null 2>&1; then cat xpart* | tar x -C w; fi) &&
    $python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/w/*.whl &&
    $python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" &&
    install_ours
}

install_ours() {
  # Our four packages as a user installs them, where benchmarks/gpu/build-wheels.sh built them
  # here and the call carried .gpu-wheels: the `vllm-interp` command and vLLM's entry points
  # (the server's tests need both). The code that runs stays the checkout's: PYTHONPATH is first.
  if ls "$root"/.gpu-wheels/*.whl > /dev/null 2>&1; then
    $python -m pip install -q --no-index --no-deps --no-compile "$root"/.gpu-wheels/*.whl &&
      command -v vllm-interp
  fi
}

trap_check() {
  # bf16 and fp32, bf16 with every step's saves moved to the host (the spill path), all eager,
  # and bf16 on vLLM's compiled engine with every value a tap (issue [K]); the four side by side
  # (each engine sizes its KV cache outright). The others keep the default limit (half the free
  # GPU memory: nothing moves there). One report, $out/inplace.md (a call returns 8 files).
  local status=0 pids=() runs=(bfloat16 float32 bfloat16-spill bfloat16-taps)
  local work
  work=$(mktemp -d)
  for run in "${runs[@]}"; do
    local spill="" engine=eager
    [ "$run" = bfloat16-spill ] && spill=VLLM_INTERP_DEVICE_SAVES_MIB=0
    [ "$run" = bfloat16-taps ] && engine=taps
    env -u VLLM_INTERP_DEVICE_SAVES_MIB $spill $python benchmarks/gpu/inplace_check.py \
      --dtype "${run%%-*}" --engine "$engine" --out "$work/$run.md" > "$work/$run.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!runs[@]}"; do
    local run=${runs[$i]}
    # A failed run's log comes back instead of its report.
    wait "${pids[$i]}" || { status=1; cp "$work/$run.log" "$out/inplace-$run.log"; }
    { cat "$work/$run.md" 2> /dev/null || echo "### $run: no report (see its log)"; echo; } \
      >> "$out/inplace.md"
  done
  grep -v WARNING "$out/inplace.md" | tail -70
  return $status
}

suites() {
  # (b) [C]'s suite with transformers on the same GPU (`suites envoys`), or [D]'s with its oracle
  # on the CPU (`suites runner`): each fits one 10-minute call. The tests that need the embedded
  # model or the CLI are left out, the interrupt test (it expects the CPU's in-process engine),
  # and the server's unless our wheels were installed (`install_ours`: they
  # start the `vllm-interp` command); tensor parallelism runs where there are two GPUs.
  local which=${1:-envoys} report=(-q -p no:cacheprovider --tb=short -rfE "${@:2}")
  # Side-by-side workers share the host's cores (their CPU oracles, transformers' threads).
  local threads=1
  [ "${PARALLEL:-1}" != family ] && threads=$(($(nproc) / ${PARALLEL:-1}))
  export TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-ieee
  if [ "${PARALLEL:-1}" = family ] && [ "$which" != envoys ]; then
    echo "check.sh: PARALLEL=family is for the envoys suite; the runner suite takes PARALLEL=n" >&2
    return 2
  elif [ "$which" = envoys ] && [ "${PARALLEL:-1}" = family ]; then
    envoys_by_family
    return
  elif [ "$which" = envoys ]; then
    # PARALLEL=n: n pytest-xdist workers on one GPU, one family's tests on one worker (its
    # engine and oracle built once; the suite's conftest groups them); each engine asks for 15%.
    local spread=()
    [ "${PARALLEL:-1}" -ge 2 ] && spread=(-n "$PARALLEL" --dist loadgroup)
    VLLM_INTERP_ORACLE_DEVICE=cuda OMP_NUM_THREADS=$threads \
      $python -m pytest "${report[@]}" "${spread[@]}" --durations=15 \
      packages/vllm-envoys/tests/test_equivalence.py packages/vllm-envoys/tests/test_values.py \
      > "$out/envoys-pytest.txt" 2>&1
  else
    # Without the tests named above and tensor parallelism, the files split in two halves that run
    # side by side, one per GPU (each its own engine); TP=2 then runs on both GPUs. On one GPU,
    # PARALLEL=n splits them in n parts run side by side there.
    local files=() status=0
    local server=test_server.py
    command -v vllm-interp > /dev/null && server=none
    for f in packages/vllm-runner/tests/test_*.py; do
      [ "$(basename "$f")" = "$server" ] && continue
      case $(basename "$f") in
        test_embedded.py|test_cli.py|test_extract.py|test_guide.py|test_readme.py|\
          test_interrupt.py|test_tensor_parallel.py|test_server_docs.py) ;;
        *) files+=("$f") ;;
      esac
    done
    if [ -n "${SHARD:-}" ]; then
      # Slices by file, interleaved in file order, so slow files (the server's) spread out.
      local shard=() index=${SHARD%/*} count=${SHARD#*/}
      for i in "${!files[@]}"; do [ $((i % count + 1)) = "$index" ] && shard+=("${files[$i]}"); done
      files=("${shard[@]}")
    fi
    local gpus
    gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -ge 2 ]; then
      # Two GPUs: the files in two halves side by side, one per GPU; TP=2 then runs on both.
      local pids=()
      for ((g = 0; g < 2; g++)); do
        local part=()
        for i in "${!files[@]}"; do [ $((i % 2)) = "$g" ] && part+=("${files[$i]}"); done
        CUDA_VISIBLE_DEVICES=$g TMPDIR=$(mktemp -d) \
          $python -m pytest "${report[@]}" "${part[@]}" > "$out/runner-$g.txt" 2>&1 &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      cat "$out"/runner-[0-9]*.txt > "$out/runner-pytest.txt"
      rm "$out"/runner-[0-9]*.txt
      $python -m pytest "${report[@]}" packages/vllm-runner/tests/test_tensor_parallel.py \
        >> "$out/runner-pytest.txt" 2>&1 || status=1
    elif [ "${PARALLEL:-1}" -ge 2 ]; then
      # PARALLEL=n on one GPU: n pytest-xdist workers side by side, a file at a time each (as
      # CI runs on the CPU); every engine of the suite sizes its KV cache outright
      # (conftest.ENGINE_MEMORY), so none profiles memory another frees. The CPU oracles share
      # the host's cores.
      OMP_NUM_THREADS=$threads \
        $python -m pytest "${report[@]}" -n "$PARALLEL" --dist loadfile --durations=25 \
        "${files[@]}" > "$out/runner-pytest.txt" 2>&1 || status=1
    else
      $python -m pytest "${report[@]}" --durations=25 "${files[@]}" > "$out/runner-pytest.txt" 2>&1 || status=1
    fi
    tail -60 "$out/runner-pytest.txt"
    return $status
  fi
  local status=$?
  tail -40 "$out/$which-pytest.txt"
  return $status
}

envoys_by_family() {
  # PARALLEL=family: one pytest process per family (VLLM_INTERP_FAMILIES), all side by side, each
  # with its own engine and oracle; on 2026-12-02 that ran the suite in 124 + 71 s where six
  # xdist workers had not finished in 550 s. Each process stops after FAMILY_LIMIT seconds, so
  # the report still comes back inside the call's limit. One file: every family's summary line,
  # the whole output of any that failed.
  local work families pids=() status=0
  work=$(mktemp -d)
  # FAMILIES="a b" runs only those (e.g. again, the ones that failed).
  families=${FAMILIES:-$(cd packages/vllm-envoys/tests &&
    $python -c "import conftest; print(*(case.name for case in conftest.CASES))")} || return 1
  for family in $families; do
    VLLM_INTERP_FAMILIES=$family OMP_NUM_THREADS=1 \
      VLLM_INTERP_ORACLE_DEVICE=${VLLM_INTERP_ORACLE_DEVICE:-cuda} \
      timeout "${FAMILY_LIMIT:-480}" $python -m pytest "${report[@]}" \
      packages/vllm-envoys/tests/test_equivalence.py packages/vllm-envoys/tests/test_values.py \
      > "$work/$family.txt" 2>&1 &
    pids+=($!)
  done
  local i=0 rc
  for family in $families; do
    wait "${pids[$i]}"
    rc=$?
    i=$((i + 1))
    echo "## $family (exit $rc): $(tail -1 "$work/$family.txt")" >> "$out/envoys-pytest.txt"
    [ "$rc" = 0 ] || { status=1; grep -v WARNING "$work/$family.txt" >> "$out/envoys-pytest.txt"; }
  done
  grep "^## " "$out/envoys-pytest.txt"
  return $status
}

require_vllm() {
  # Every command but the installs needs the staged vLLM; without it (a piece missing, a refused
  # first call) fail in seconds, not after a suite's or benchmark's whole limit.
  $python -c "import vllm" > /dev/null 2>&1 && return 0
  echo "check.sh: vLLM does not import from /tmp/site: copy every staged piece to /tmp/stage" \
    "($(ls /tmp/stage 2> /dev/null | grep -c '^part') there now), then run 'check.sh install'" >&2
  return 1
}

families_compiled() {
  # Issue [K] "the equivalence suites with graphs on": every family case of the envoys suite,
  # our engine compiled (CUDA graphs) with every value tapped against our eager engine, nine
  # families side by side (benchmarks/compiled_families_check.py; DeepSeek in bfloat16).
  VLLM_INTERP_ORACLE_DEVICE=cuda OMP_NUM_THREADS=1 TRITON_F32_DEFAULT=ieee \
    $python benchmarks/compiled_families_check.py --parallel "${PARALLEL:-9}" "$@" \
    > "$out/families-compiled.txt" 2>&1
  local status=$?
  grep -v WARNING "$out/families-compiled.txt" | tail -40
  return $status
}

record() {
  # Real steps of vLLM's V2 runner as the adapter's test fixture (benchmarks/gpu/record_v2_steps.py).
  $python benchmarks/gpu/record_v2_steps.py "$1" "$out/v2_steps.json" \
    > "$out/record.log" 2>&1
  local status=$?
  grep -v WARNING "$out/record.log" | tail -15
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

compiled() {
  # Issue [K]: ours compiled with taps against vLLM's real default (CUDA graphs, compiled), on
  # the runner vLLM picks (V2 unless VLLM_USE_V2_MODEL_RUNNER=0), each engine in its own process.
  # ARMS="a,b,d" runs only those arms (all by default; the eager engine only with its arm);
  # PROFILE=1 then profiles the default engine and each arm once (cProfile, torch's profiler;
  # PROFILERS=timeline instead: each thread's time in and around the CUDA-graph replay).
  # APART=1 runs every engine's core in a process of its own, as vLLM does by default.
  local shape=${1:-smollm2-135m} repeats=${2:-3} requests=${3:-256}
  local name="compiled-$shape"
  $python benchmarks/compiled_bench.py --shape "$shape" --dtype bfloat16 --repeats "$repeats" \
    --concurrency 64 --requests "$requests" --max-tokens 128 --out "$out/$name.md" ${ARMS:+--arms "$ARMS"} \
    ${APART:+--engine-core-apart} \
    ${PROFILE:+--profile "$out/$name-profile.md"} ${PROFILERS:+--profilers "$PROFILERS"} \
    > "$out/$name.log" 2>&1
  local status=$?
  grep -v WARNING "$out/$name.log" | grep -v "Capturing CUDA graphs" | tail -30
  return $status
}

sae() {
  # Issue [P]: the SAE ops at the Llama-3.1-8B shape (vLLM's dummy weights) against vLLM's default
  # engine, each in its own process: 256 requests x (512 prompt + 128 generated), SAEs of 65,536
  # features at layer 16 (docs/benchmarks.md, "SAE features at the Llama-3.1-8B shape"). ~420 s
  # on an H100 with 3 repeats.
  local repeats=${1:-3}
  $python benchmarks/compiled_bench.py --shape llama-3.1-8b --dummy-weights --dtype bfloat16 \
    --arms "${ARMS:-a,sf,sf32,ss,sc}" --requests 256 --concurrency 256 --prompt-tokens 512 \
    --max-tokens 128 --sae-width 65536 --repeats "$repeats" --gpu-memory-utilization 0.42 \
    --out "$out/sae-gpu.md" > "$out/sae-gpu.log" 2>&1
  local status=$?
  grep -v WARNING "$out/sae-gpu.log" | grep -v "Capturing CUDA graphs" | tail -30
  return $status
}

headline() {
  # Issue [T]: docs/benchmarks.md's headline table, one shape a call (llama-3.1-8b,
  # qwen3-30b-a3b-12l): 256 requests x (512 prompt + 128 generated) against vLLM's default
  # engine, each in its own process, then the A/A twin. ARMS= picks arms (all by default: ~15
  # minutes at the 8B shape, more than a call: split them over calls, NO_TWIN=1 on all but one;
  # PART= names each call's result file); COMMIT= the commit measured (no git there).
  # Results: $out/headline/<shape>[-PART].json, for `benchmarks/headline.py --render`.
  local shape=${1:-llama-3.1-8b}
  mkdir -p "$out/headline"
  local name="$shape${PART:+-$PART}"
  $python benchmarks/headline.py --shape "$shape" ${ARMS:+--arms "$ARMS"} \
    ${NO_TWIN:+--no-twin} --repeats "${REPEATS:-3}" --commit "${COMMIT:-unknown}" \
    --out "$out/headline/$name.json" > "$out/headline/$name.log" 2>&1
  local status=$?
  grep -v WARNING "$out/headline/$name.log" | grep -v "Capturing CUDA graphs" | tail -30
  return $status
}

case ${1:-} in
  install|install_ours) ;;
  *) require_vllm || exit 3 ;;
esac
"$@"
