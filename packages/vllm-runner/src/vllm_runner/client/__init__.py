"""The client: `LLM` and `AsyncLLM` over vLLM's engines, `llm.trace`, `n > 1` fanned out into
one request per sample, the engine's start-up defaults and the embedded default model.

Runs in the user's process. It encodes programs (`ops`), hands them to vLLM as request data,
and decodes what the workers collected (`saves.wire`); it talks to the engine through vLLM's
public API and the worker RPCs of `engine`. Internal: import from `vllm_runner`.
"""
