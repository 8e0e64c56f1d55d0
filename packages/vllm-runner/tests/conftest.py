"""One tiny random Llama, its transformers reference, and one shared in-process engine."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import LlamaConfig, LlamaForCausalLM

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# On a GPU, float32 runs vLLM's Triton attention, whose dots default to TF32 (relative error
# ~5e-4, over the oracle's tolerance); IEEE float32 keeps the comparison exact. No effect on CPU.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

# This suite's property tests share the host's cores with engines, their compilers and the
# transformers oracles (pytest-xdist workers; five side by side on the GPU host), so how long a
# draw or an example takes measures the host's load, not the strategy: on the H100 one draw of
# `test_non_finite`'s at most 40 floats took 4.6 s once and failed the too-slow health check
# (2026-12-06). What the tests assert does not depend on time.
settings.register_profile("shared-host", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-host")

# Log-probabilities of one request run in different batches (or in one batch, split into chunks
# differently) agree to this much: GPU attention kernels are not invariant to how a prompt is
# split into chunks, and the last bits of float32 differ (seen on the H200: 2.4e-7).
LOGPROB_TOLERANCE = 1e-5

PROMPTS = [[5, 17, 99, 3, 42], [250, 7, 61, 8, 120, 33, 14, 2, 77, 19, 4], [91, 45, 12]]
GENERATED = 4
# ~1.3 MB of saves for a 120-token prompt: enough to cross from an engine core in a process of
# its own through shared memory (`wire.SHARED_MIN_BYTES`).
LARGE_PROMPT = [(7 * i) % 250 + 1 for i in range(120)]
LARGE_SAVES = ["layers.*.attention_probabilities", "layers.*.mlp_neurons",
               "layers.*.layer_output"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def byte_tokenizer():
    """A tokenizer with one token per byte (ids 0-255, the model's vocabulary) and a chat
    template, built here because no tokenizer can be downloaded."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=alphabet[2])
    wrapped.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                             "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    return wrapped


@pytest.fixture(scope="session")
def reference(model_dir: str) -> LlamaForCausalLM:
    """transformers on the same weights (eager attention): the oracle."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.set_attn_implementation("eager")
    return model.eval()


# Every engine of the suite: a small share of a GPU, and its KV cache sized outright, so no
# engine sizes it by profiling free memory. Profiling fails when another process frees GPU
# memory meanwhile (vLLM's "Error in memory profiling"), and on the lent GPU the suite's slices
# run side by side (`benchmarks/gpu/check.sh`, PARALLEL). Scripts spell the same out.
ENGINE_MEMORY = {"gpu_memory_utilization": 0.15, "kv_cache_memory_bytes": 64 << 20}
# The suite's engine compiled as vLLM's default engine is (issue [K]: the suite passes with graphs
# on and with enforce_eager=True): `VLLM_INTERP_SUITE_COMPILED=1`, as `nox -s tests` sets for its
# second pass of vllm-runner. Compiled, it has taps, so the suite's programs run through all three
# paths: `Add`s and `Save`s at layer outputs inside the graph, other ops there and MLP neurons at
# the tap op, anything else in the plain module tree.
SUITE_COMPILED_VARIABLE = "VLLM_INTERP_SUITE_COMPILED"
SUITE_COMPILED = os.environ.get(SUITE_COMPILED_VARIABLE) == "1"
SUITE_TAPS = {"taps": ["layers.*.mlp_neurons"], "graph_taps": ["layers.*.layer_output"]}
#: The keywords of the suite's engine: compiled with those taps, or eager. Eager is spelled out:
#: `LLM`'s default is eager on a CPU only (on a GPU, vLLM's compiled engine).
SUITE_ENGINE: dict[str, object] = ({"enforce_eager": False, **SUITE_TAPS} if SUITE_COMPILED
                                   else {"enforce_eager": True})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With the suite's engine compiled (`SUITE_COMPILED`), only the tests that use it run: the
    others start engines of their own, the same with it or without. Tests marked
    `first_pass_only` are left out too: those whose engines are their own, eager and compiled
    alike (the suite's engine only their oracle: test_compiled.py, test_tensor_parallel.py,
    test_transformers_backend.py), and those whose subject does not change with how the engine
    runs (a server's vector registry). Compiled they would test nothing more than the first pass
    and start their processes twice, in a CI run that must stay under 30 minutes."""
    if not SUITE_COMPILED:
        return
    kept = [item for item in items if "llm" in getattr(item, "fixturenames", ())
            and item.get_closest_marker("first_pass_only") is None]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


def random_sae(architecture: str, hook_name: str, d_in: int = 128, d_sae: int = 512,
               seed: int = 0, **fields):
    """A random SAE of `architecture` trained, its files say, at `hook_name`; its encoder
    scaled so that a few dozen of its features are active at a token of the suite's model."""
    from saecodec import SAE, Site

    generator = torch.Generator().manual_seed(seed)
    w_enc = torch.randn(d_in, d_sae, generator=generator) / d_in ** 0.5 * 2.0
    w_dec = torch.randn(d_sae, d_in, generator=generator) / d_in ** 0.5
    threshold = (torch.rand(d_sae, generator=generator) * 0.4 + 0.2
                 if architecture == "jumprelu" else None)
    return SAE(architecture, w_enc, torch.randn(d_sae, generator=generator) * 0.1, w_dec,
               torch.randn(d_in, generator=generator) * 0.05, threshold=threshold,
               site=Site(hook_name=hook_name), **fields)


#: The suite engine's SAEs: name -> (architecture, site in its files, extra fields).
SUITE_SAES = {"res1": ("jumprelu", "blocks.1.hook_resid_post", {}),
              "mlp0": ("topk", "blocks.0.hook_mlp_out", {"k": 8}),
              "pre2": ("standard", "blocks.2.hook_resid_pre", {"apply_b_dec_to_input": True})}


@pytest.fixture(scope="session")
def sae_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The suite's SAEs written in SAELens's native format (which `saecodec` reads and writes
    as SAELens does: its own tests check that against SAELens)."""
    found = {}
    for seed, (name, (architecture, hook_name, fields)) in enumerate(SUITE_SAES.items()):
        path = tmp_path_factory.mktemp(f"sae-{name}")
        random_sae(architecture, hook_name, seed=seed, **fields).save(path)
        found[name] = str(path)
    return found


@pytest.fixture(scope="session")
def llm(model_dir: str, reference, sae_dirs):
    """The suite's engine, with its SAEs (the reference loads first; the engine then owns the
    CPU)."""
    from vllm_runner import LLM

    # An 8-token budget makes the prompts share steps and spreads the longest over three; 32-token
    # KV blocks (the CPU kernel's smallest) let prompts of a few dozen tokens share cache blocks.
    return LLM(model_dir, dtype="float32", **ENGINE_MEMORY,
               max_model_len=128, max_num_seqs=8, max_num_batched_tokens=8, block_size=32,
               seed=0, saes=sae_dirs, **SUITE_ENGINE)


@torch.no_grad()
def greedy(model, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, token by token: the oracle's tokens."""
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def logprob_steps(output) -> list[dict[int, float]]:
    """A completion's top log-probabilities, step by step, as plain numbers."""
    return [{token: lp.logprob for token, lp in step.items()}
            for step in output.outputs[0].logprobs]


def same_logprobs(one, other) -> bool:
    """Whether two completions chose the same tokens with the same top log-probabilities, up to
    `LOGPROB_TOLERANCE` (exact equality would fail on a GPU for reasons that are not ours)."""
    first, second = logprob_steps(one), logprob_steps(other)
    return list(one.outputs[0].token_ids) == list(other.outputs[0].token_ids) and \
        len(first) == len(second) and all(
            a.keys() == b.keys() and all(abs(a[t] - b[t]) <= LOGPROB_TOLERANCE for t in a)
            for a, b in zip(first, second, strict=True))


# Values of one request from two engines (a server's and the suite's): equal bit for bit on the
# CPU; on a GPU to this much, since its kernels are not batch-invariant.
ACROSS_ENGINES = 2e-3 if torch.cuda.is_available() else 0.0


def same_values(one: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two engines' values of the same request agree (`ACROSS_ENGINES`)."""
    if not ACROSS_ENGINES:
        return torch.equal(one, other)
    return one.shape == other.shape and torch.allclose(one, other, rtol=ACROSS_ENGINES,
                                                       atol=ACROSS_ENGINES / 10)


def as_in_a_terminal() -> None:
    """`preexec_fn` for a child that a test interrupts with Ctrl-C: SIGINT handled as in a
    terminal. A process started in the background by a non-interactive shell (a CI script's
    `cmd &`) inherits SIGINT ignored, and Python then never raises `KeyboardInterrupt`."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def user_environment() -> dict[str, str]:
    """This process's environment without the variables the test suite sets for its own
    engines (conftest): what a user's shell has."""
    return {name: value for name, value in os.environ.items()
            if name not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "TRITON_F32_DEFAULT",
                            SUITE_COMPILED_VARIABLE)}


def suite_numerics() -> dict[str, str]:
    """The numerics this suite's engines use (IEEE float32 in Triton), for another engine whose
    values are compared with theirs: in the user's default (TF32) a float32 GPU engine's values
    are ~1e-3 from the suite's (measured on the H200), which no comparison of ours allows."""
    return {name: os.environ[name] for name in ("TRITON_F32_DEFAULT",) if name in os.environ}


#: For a bare vLLM engine's script: `enforce_eager=` as the suite's own engine has it.
SUITE_EAGER_IN_SCRIPT = repr(not SUITE_COMPILED)
#: For a script's engine of ours: the suite's engine's keywords (`SUITE_ENGINE`).
SUITE_ENGINE_IN_SCRIPT = repr(SUITE_ENGINE)
#: For a script whose engine core runs apart: the sizes of the files in shared memory its saves
#: came through, in `attached` (`shm_files.attach` counted in the client's process).
COUNT_ATTACHED_IN_SCRIPT = """
from vllm_runner.saves import shm_files
attached = []
attach = shm_files.attach
def counted(path, size):
    attached.append(size)
    return attach(path, size)
shm_files.attach = counted
"""


def engine_script_environment() -> dict[str, str]:
    """The environment for a test's own engine script (not a command a user runs): the user's,
    plus the suite's numerics, so its values can be compared with this process's engine to the
    same tolerance."""
    return {**user_environment(), **suite_numerics()}


@contextlib.contextmanager
def serving(command: list[str], base: str, log_path: Path, cwd: Path | None = None,
            seconds: float = 400, environment: dict[str, str] | None = None) -> Iterator[str]:
    """A server process started as a user starts it (`command`, the user's environment and
    what `environment` adds to it), from when `base`/health answers until the block ends; its
    log's end in any failure."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                   env={**user_environment(), **(environment or {})})
    deadline = time.monotonic() + seconds
    try:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the server exited ({process.returncode}):\n"
                                     f"{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise AssertionError(f"no server after {seconds} s:\n"
                                         f"{log_path.read_text()[-4000:]}") from None
                time.sleep(1)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a Markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


#: What the extraction tests save (`test_extract`, `test_extract_ray`).
EXTRACTED_LOCATIONS = ["layers.*.layer_output", "layers.1.mlp_neurons"]


@pytest.fixture(scope="session")
def extraction_prompts() -> list[str]:
    """50 short prompts of 1-6 words, the extraction tests' input."""
    import random

    words = ["the", "a", "cat", "dog", "sat", "on", "mat", "runs", "fast", "blue", "tree"]
    generator = random.Random(4)
    return [" ".join(generator.choices(words, k=generator.randint(1, 6))) for _ in range(50)]


@pytest.fixture(scope="session")
def extraction_saves(llm, extraction_prompts: list[str]) -> list[dict[str, torch.Tensor]]:
    """What `generate` saves in memory for `extraction_prompts`, the extractions' oracle."""
    from vllm import SamplingParams
    from vllm_runner import ops

    outputs = llm.generate(extraction_prompts, SamplingParams(max_tokens=1, temperature=0.0),
                           interventions=[ops.Save(loc) for loc in EXTRACTED_LOCATIONS],
                           use_tqdm=False)
    return [output.saved for output in outputs]
