#!/usr/bin/env bash
# The wheels vLLM 0.34 needs on the lent GPU beyond ../shared/gpu/stage-0.34.sh's list: its
# engine start (`kernel_warmup`, on CUDA) imports the MiniMax-M3 warmup, which imports CuTe DSL
# (`cutlass`, nvidia-cutlass-dsl) and `quack` unconditionally; without them every engine fails
# to start ("No module named 'cutlass'", seen on an H100). Run it after stage-0.34.sh, from the
# checkout: .gpu-stage-034/xpart00, xpart01 (56 MiB at most each; carried like the others, one
# a call), which `check.sh install` unpacks with the parts.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
stage="$root/.gpu-stage-034"
mkdir -p "$stage"
work=$(mktemp -d)
plat=""
for n in 39 35 34 28 27 24 17; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $plat --platform manylinux2014_x86_64 -d "$work" \
  "nvidia-cutlass-dsl==4.8.0" "nvidia-cutlass-dsl-libs-base==4.8.0" \
  "nvidia-cutlass-dsl-libs-cu13==4.8.0" "quack-kernels==0.6.5" "torch-c-dlpack-ext==0.1.5" "einops"
ls "$work"
tar cf "$work/extra.tar" -C "$work" $(cd "$work" && ls *.whl)
rm -f "$stage"/xpart*
split -b 56M -d "$work/extra.tar" "$stage/xpart"
rm -rf "$work"
ls -la "$stage"/xpart*
