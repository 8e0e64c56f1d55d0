"""`vllm_runner.AsyncLLM` as a user's asyncio program runs it (a script, the user's environment
with this suite's float32 numerics: vLLM's engine core in its own process), against the offline
`LLM` on the same weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from conftest import (
    COUNT_ATTACHED_IN_SCRIPT,
    LARGE_PROMPT,
    LARGE_SAVES,
    PROMPTS,
    SUITE_ENGINE_IN_SCRIPT,
    engine_script_environment,
)
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops
from vllm_runner.saves import wire

STEER = torch.randn(128, generator=torch.Generator().manual_seed(5))

SCRIPT = '''
import asyncio, sys
import torch
from vllm import SamplingParams
from vllm_runner import AsyncLLM, ops
COUNT_ATTACHED

PROMPTS, STEER, LARGE_PROMPT, LARGE_SAVES, SAE = torch.load(sys.argv[2])

async def main():
    # A small share of a GPU: the test's own offline engine holds memory beside this one.
    engine = AsyncLLM(sys.argv[1], dtype="float32", max_model_len=128, max_num_seqs=8,
                      kv_cache_memory_bytes=64 << 20, gpu_memory_utilization=0.15, seed=0,
                      saes={"res1": SAE}, **SUITE_ENGINE)
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def last(index, interventions):
        final = None
        async for output in engine.generate({"prompt_token_ids": PROMPTS[index]}, params,
                                            f"request-{index}", interventions=interventions):
            final = output
        return final

    saved, steered, plain = await asyncio.gather(
        last(0, [ops.Save("layers.*.layer_output")]),
        last(1, [ops.Add("layers.1.layer_output", STEER, scale=8.0)]),
        last(2, None))
    # An SAE by name: its features read, its directions steered by.
    features = await last(0, [ops.Features(sae="res1", top_k=6),
                              ops.SteerFeatures(sae="res1", features={3: 4.0})])
    sae_table = await engine.saes()
    final = None  # ~1.3 MB of saves: through shared memory
    async for output in engine.generate({"prompt_token_ids": LARGE_PROMPT}, params, "large",
                                        interventions=[ops.Save(saved) for saved in LARGE_SAVES]):
        final = output
    large = final
    # A request its caller stops reading: aborted, and what it saved is freed.
    stream = engine.generate({"prompt_token_ids": PROMPTS[0]},
                             SamplingParams(max_tokens=100, ignore_eos=True), "stopped",
                             interventions=[ops.Save("layers.*.layer_output")])
    async for _ in stream:
        break
    await stream.aclose()
    # A default program (issue [Q]): a request naming no interventions runs it; [] runs none.
    engine.default_interventions = [ops.Add("layers.1.layer_output", STEER, scale=8.0)]
    by_default, none = await asyncio.gather(last(1, None), last(2, []))
    engine.default_interventions = []
    (held, *_) = await engine.collective_rpc("interp_held")
    torch.save({"by_default": list(by_default.outputs[0].token_ids),
                "by_default_error": by_default.error, "none_saved": none.saved,
                "none": list(none.outputs[0].token_ids),
                "saved": saved.saved, "saved_tokens": list(saved.outputs[0].token_ids),
                "steered": list(steered.outputs[0].token_ids), "errors": [
                    saved.error, steered.error, plain.error],
                "plain": list(plain.outputs[0].token_ids), "plain_saved": plain.saved,
                "held": held, "large": large.saved, "large_error": large.error,
                "attached": attached, "features": features.saved,
                "features_error": features.error, "sae_table": sae_table,
                "features_tokens": list(features.outputs[0].token_ids)}, sys.argv[3])
    engine.shutdown()

if __name__ == "__main__":  # vLLM starts its engine core in a process of its own (spawn)
    asyncio.run(main())
'''.replace("SUITE_ENGINE", SUITE_ENGINE_IN_SCRIPT).replace(
    "COUNT_ATTACHED", COUNT_ATTACHED_IN_SCRIPT)


def test_async_generate_equals_the_offline_llm_and_frees_a_stopped_request(
        model_dir: str, llm, tmp_path: Path, sae_dirs) -> None:
    (tmp_path / "run.py").write_text(SCRIPT)
    torch.save((PROMPTS, STEER, LARGE_PROMPT, LARGE_SAVES, sae_dirs["res1"]),
               tmp_path / "inputs.pt")
    ran = subprocess.run([sys.executable, "run.py", model_dir, "inputs.pt", "out.pt"],
                         cwd=tmp_path, env=engine_script_environment(), capture_output=True,
                         text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-4000:]
    got = torch.load(tmp_path / "out.pt")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    saved, steered, plain = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS], params,
        interventions=[[ops.Save("layers.*.layer_output")],
                       [ops.Add("layers.1.layer_output", STEER, scale=8.0)], []],
        use_tqdm=False)
    assert got["errors"] == [None, None, None]
    assert got["saved_tokens"] == list(saved.outputs[0].token_ids)
    assert got["saved"].keys() == saved.saved.keys() and len(saved.saved) == 3
    # Bit for bit on the CPU; on a GPU to the last bits only, since its kernels are not
    # batch-invariant and the two engines split the prompts into different steps.
    tolerance = 1e-4 if torch.cuda.is_available() else 0.0
    for name in saved.saved:
        torch.testing.assert_close(got["saved"][name], saved.saved[name], rtol=tolerance,
                                   atol=tolerance / 10)
    assert got["steered"] == list(steered.outputs[0].token_ids)
    assert got["plain"] == list(plain.outputs[0].token_ids) and got["plain_saved"] == {}
    assert got["by_default"] == got["steered"] and got["by_default_error"] is None
    assert got["none"] == got["plain"] and got["none_saved"] == {}
    assert got["steered"] != list(llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])],
                                               params, use_tqdm=False)[0].outputs[0].token_ids)
    assert got["held"] == {"requests": 0, "bytes": 0}
    (features,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], params,
                               interventions=[ops.Features(sae="res1", top_k=6),
                                              ops.SteerFeatures(sae="res1", features={3: 4.0})],
                               use_tqdm=False)
    assert got["features_error"] is None and got["sae_table"] == {"res1": llm.saes["res1"]}
    assert got["features_tokens"] == list(features.outputs[0].token_ids)
    indices, values = "res1.features.indices", "res1.features.values"
    assert torch.equal(got["features"][indices], features.saved[indices])
    # The encoding's sums follow the process's CPU threads: float32's precision across engines.
    torch.testing.assert_close(got["features"][values], features.saved[values], rtol=1e-5,
                               atol=1e-5)
    # Only the large request's saves came through a file in shared memory, and came whole.
    (size,) = got["attached"]
    assert size >= wire.SHARED_MIN_BYTES and got["large_error"] is None
    (large,) = llm.generate([TokensPrompt(prompt_token_ids=LARGE_PROMPT)], params,
                            interventions=[ops.Save(location) for location in LARGE_SAVES],
                            use_tqdm=False)
    assert got["large"].keys() == large.saved.keys() and len(large.saved) == 9
    # The offline engine prefills 8 tokens a step, this one the whole prompt: the same values
    # to float32 rounding (the transport itself is exact: test_wire.py).
    for name in large.saved:
        torch.testing.assert_close(got["large"][name], large.saved[name], rtol=1e-4, atol=1e-5)
