"""vLLM 0.34's engine start on CUDA imports its MiniMax-M3 warmup, whose modules import CuTe DSL
(`cutlass`), whatever the model; a MoE router gate with fp32 weights on Hopper imports a CuTe DSL
router GEMM to register its warmup. The nvidia-cutlass-dsl 4.8.0 wheels staged for the lent GPU
hold no `cutlass` Python package (only its MLIR bindings and libraries), so every engine would
fail to start. `check.sh` puts this folder first on the path only then, and both modules get a
stand-in: the MiniMax-M3 warmup becomes the no-op it is for every other model (it returns at
once where the model has no MiniMax-M3 sparse attention), the router GEMM registers no warmup,
and calling that GEMM (only bf16 inputs against fp32 router weights would) raises. The stand-ins
are made only when vLLM imports those modules, so no process that never imports vLLM sees a
vLLM module."""

import importlib.abc
import importlib.machinery
import sys
import types

_WARMUP = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
# A MoE router gate with fp32 weights on Hopper registers this CuTe DSL kernel's warmup when it is
# built; the kernel itself runs only for bf16 inputs against fp32 router weights, which no check
# here has: calling it says so instead of computing anything.
_SM90_ROUTER_GEMM = "vllm.model_executor.layers.fused_moe.router.bf16x3_router_gemm_sm90"


class _NoWarmupKernel:
    def register_warmup(self, **_shape: int) -> None:
        return None


def _no_cutedsl(*_args, **_kwargs):  # type: ignore[no-untyped-def]
    raise RuntimeError("CuTe DSL's cutlass package is not staged: the bf16x3 router GEMM "
                       "cannot run")


class _NoOpWarmup(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname not in (_WARMUP, _SM90_ROUTER_GEMM):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return types.ModuleType(spec.name)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        module.minimax_m3_msa_warmup = lambda worker: None
        module._SM90_BF16X3_ROUTER_GEMM_KERNEL = _NoWarmupKernel()
        module.bf16x3_router_gemm = module._bf16x3_router_gemm = _no_cutedsl


sys.meta_path.insert(0, _NoOpWarmup())
