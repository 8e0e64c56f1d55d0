"""vLLM 0.34's engine start on CUDA imports its MiniMax-M3 warmup, whose modules import CuTe DSL
(`cutlass`), whatever the model. The nvidia-cutlass-dsl 4.8.0 wheels staged for the lent GPU
hold no `cutlass` Python package (only its MLIR bindings and libraries), so every engine would
fail to start. `check.sh` puts this folder first on the path only then: the warmup becomes the
no-op it is for every model but MiniMax-M3 (it returns at once where the model has no
MiniMax-M3 sparse attention), and nothing else changes. The stand-in is made only when vLLM
imports that module, so no process that never imports vLLM sees a vLLM module."""

import importlib.abc
import importlib.machinery
import sys
import types

_WARMUP = "vllm.model_executor.warmup.minimax_m3_msa_warmup"


class _NoOpWarmup(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname != _WARMUP:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return types.ModuleType(spec.name)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        module.minimax_m3_msa_warmup = lambda worker: None


sys.meta_path.insert(0, _NoOpWarmup())
