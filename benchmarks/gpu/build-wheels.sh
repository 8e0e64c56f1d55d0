#!/usr/bin/env bash
# Our five packages as wheels in .gpu-wheels/ (~200 KB, git-ignored), for a device call to carry
# (carry=[".gpu-wheels"]): `check.sh install` then installs them as a user would, so the server's
# tests find the `vllm-interp` command and vLLM finds our endpoint plugin. Run from the root.
set -euo pipefail
rm -rf .gpu-wheels
python -m pip wheel -q --no-deps -w .gpu-wheels ./packages/tokenspan ./packages/tpfragments \
  ./packages/vllm-envoys ./packages/vllm-runner ./packages/saecodec
# pytest-xdist for `PARALLEL=n check.sh suites runner` (the device image has pytest, not xdist).
python -m pip download -q --no-deps --only-binary=:all: -d .gpu-wheels "pytest-xdist>=3.6" "execnet>=2.1"
ls .gpu-wheels
