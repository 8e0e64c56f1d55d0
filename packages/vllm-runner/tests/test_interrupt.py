"""Ctrl-C in a terminal (issue [H] item 4, as it was seen): SIGINT to the whole process group
during a long `generate` with saves. Before, `generate` then blocked for over ten minutes on a
call into the engine processes the same signal had stopped. Now `KeyboardInterrupt` comes back
within seconds; the same `LLM` still works where its engine lives in the process (a CPU with one
rank: the default) or fails at once with `EngineDied` where the signal stopped its processes
(vLLM's multiprocess engine); a second `LLM` works either way. The child runs in its own process
group, as a script in a terminal does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import PROMPTS, as_in_a_terminal, greedy
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

SCRIPT = """
import json, sys, time
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import EngineDied, LLM, ops
def engine():
    return LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=128,
               max_num_seqs=8)

def tokens(llm):
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=json.loads(sys.argv[2]))],
                          SamplingParams(max_tokens=3, temperature=0.0),
                          interventions=[ops.Save("layers.0.layer_output")], use_tqdm=False)
    return json.dumps(list(out.outputs[0].token_ids))

if __name__ == "__main__":
    llm = engine()
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 250 + 1 for j in range(10)])
               for i in range(256)]
    print("READY", flush=True)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                     interventions=[ops.Save("layers.*.layer_output")], use_tqdm=False)
        print("FINISHED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    started = time.monotonic()
    try:
        print("SAME", tokens(llm), flush=True)
    except EngineDied:
        print("DEAD", time.monotonic() - started, flush=True)
    print("SECOND", tokens(engine()), flush=True)
"""


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multiprocess"])
def test_ctrl_c_returns_within_seconds_and_a_new_llm_works(model_dir, reference,
                                                           multiprocess) -> None:
    environment = {name: value for name, value in os.environ.items()
                   if name != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # set by conftest
    if multiprocess:
        environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    child = subprocess.Popen([sys.executable, "-c", SCRIPT, model_dir, json.dumps(PROMPTS[2])],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=environment, start_new_session=True,
                             preexec_fn=as_in_a_terminal)
    lines: dict[str, str] = {}
    log: list[str] = []
    sent = None
    # A hung child must fail the test, not hang it: past the deadline its group is killed,
    # which ends the reading below.
    watchdog = threading.Timer(240, os.killpg, (child.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in child.stdout:
            log.append(line)
            marker, _, rest = line.strip().partition(" ")
            if marker in ("READY", "INTERRUPTED", "FINISHED", "SAME", "DEAD", "SECOND"):
                lines[marker] = rest
            if marker == "READY":
                time.sleep(2)  # well inside the generate: it runs for tens of seconds
                sent = time.monotonic()
                os.killpg(child.pid, signal.SIGINT)
            if marker == "INTERRUPTED":
                assert time.monotonic() - sent < 30, "KeyboardInterrupt came back too late"
        child.wait(timeout=240)
    finally:
        watchdog.cancel()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    output = "".join(log)[-4000:]
    assert "INTERRUPTED" in lines, output
    expected = json.dumps(greedy(reference, PROMPTS[2], 3))
    if multiprocess:
        # At once, not after the RPCs' 300-s timeout: as soon as vLLM sees the engine's
        # process gone, which took 1.5 s on two loaded cores (it failed a 1-s bound in CI on
        # 2026-12-02, and in 1 of 3 runs alone).
        assert "DEAD" in lines, output  # the child's own output says what it did instead
        assert float(lines["DEAD"]) < 10, output
    else:
        assert lines.get("SAME") == expected, output
    assert lines.get("SECOND") == expected, output
    assert child.returncode == 0, output


def test_an_interrupt_between_a_steps_forward_and_its_sampling_leaves_the_same_llm_working(
        llm, reference) -> None:
    """Where the Ctrl-C above can land on a loaded machine (seen once, with the suite's engine
    compiled): vLLM's in-process engine core runs a step's forward, then its sampling, in two
    calls; a `KeyboardInterrupt` between them left its runner refusing every later step. Here it
    lands there on purpose, on the suite's in-process engine."""
    executor = llm.engine.llm_engine.model_executor

    def interrupted(*args, **kwargs):
        del executor.sample_tokens  # once: the executor's own method again
        raise KeyboardInterrupt

    executor.sample_tokens = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])],
                     SamplingParams(max_tokens=4, temperature=0.0),
                     interventions=[ops.Save("layers.0.layer_output")], use_tqdm=False)
    assert "sample_tokens" not in vars(executor)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[2])],
                          SamplingParams(max_tokens=3, temperature=0.0),
                          interventions=[ops.Save("layers.0.layer_output")], use_tqdm=False)
    assert out.error is None
    assert list(out.outputs[0].token_ids) == greedy(reference, PROMPTS[2], 3)
    (held,) = llm.engine.collective_rpc("interp_held")
    assert not any(held.values()), held  # the cut call's saves were freed too
