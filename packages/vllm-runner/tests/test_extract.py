"""Extraction to disk: what `extract` writes equals what `generate` saves in memory for the same
prompts, and a run killed half way (between writing a shard and recording it, the worst moment)
then resumed yields every row exactly once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import EXTRACTED_LOCATIONS, user_environment
from vllm import SamplingParams
from vllm_runner import ops
from vllm_runner.cli.extract import ExtractionMismatch, extract, load


def _assert_equal_to_memory(records: list[dict], extraction_saves: list[dict]) -> None:
    assert [record["index"] for record in records] == list(range(len(extraction_saves)))
    for record, saved in zip(records, extraction_saves, strict=True):
        assert set(record) - {"index", "token_ids"} == set(saved)
        for location, value in saved.items():
            # Different batches may round differently in the last bits; nothing more.
            torch.testing.assert_close(record[location], value[0], rtol=1e-5, atol=1e-5)


def test_extract_writes_what_generate_saves(llm, extraction_prompts, extraction_saves,
                                            tmp_path) -> None:
    out = extract(llm, extraction_prompts, EXTRACTED_LOCATIONS, tmp_path / "run", shard_size=8,
                  progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [shard["index"] for shard in manifest["shards"]] == list(range(7))  # 50 / 8
    _assert_equal_to_memory(list(load(out)), extraction_saves)
    with pytest.raises(ExtractionMismatch, match="shard_size"):
        extract(llm, extraction_prompts, EXTRACTED_LOCATIONS, out, shard_size=16, progress=False)


def test_extract_writes_the_sae_features_generate_gives(llm, extraction_prompts, tmp_path) -> None:
    """`features=`: each SAE's sparse features (`ops.Features`) per prompt, beside a location,
    equal to what `generate` gives in memory (a standard SAE's every active feature, `top_k`
    None, as wide as each prompt's busiest token); the SAEs and top-k are part of the
    settings."""
    features = {"res1": 6, "mlp0": None, "pre2": None}
    out = extract(llm, extraction_prompts[:12], ["layers.0.layer_output"], tmp_path / "run",
                  shard_size=5, progress=False, features=features)
    outputs = llm.generate(extraction_prompts[:12], SamplingParams(max_tokens=1, temperature=0.0),
                           interventions=[ops.Save("layers.0.layer_output"),
                                          ops.Features(sae="res1", top_k=6),
                                          ops.Features(sae="mlp0"),
                                          ops.Features(sae="pre2")], use_tqdm=False)
    records = list(load(out))
    assert len(records) == 12
    for record, output in zip(records, outputs, strict=True):
        assert set(record) - {"index", "token_ids"} == set(output.saved) == {
            "layers.0.layer_output", "res1.features.indices", "res1.features.values",
            "mlp0.features.indices", "mlp0.features.values", "pre2.features.indices",
            "pre2.features.values"}
        assert record["res1.features.indices"].shape == (len(record["token_ids"]), 6)
        assert record["mlp0.features.indices"].shape == (len(record["token_ids"]), 8)
        assert record["pre2.features.indices"].shape[1] == int(
            (record["pre2.features.indices"] >= 0).sum(-1).max())
        for name, value in output.saved.items():
            torch.testing.assert_close(record[name], value[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ExtractionMismatch, match="features"):
        extract(llm, extraction_prompts[:12], ["layers.0.layer_output"], out, shard_size=5,
                progress=False, features={"res1": 7})


def test_a_killed_extraction_resumes_with_every_row_once(extraction_prompts, extraction_saves,
                                                         model_dir, tmp_path) -> None:
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(extraction_prompts) + "\n")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "vllm_runner.cli", "extract", "--model", model_dir,
               "--prompts", str(prompt_file), "--save", ",".join(EXTRACTED_LOCATIONS),
               "--out", str(out), "--shard-size", "8", "--max-model-len", "128",
               "--dtype", "float32"]
    environment = user_environment()  # as a user runs the command
    killed = subprocess.run(command, env={**environment, "VLLM_INTERP_EXTRACT_CRASH_AFTER": "3"},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == 17, killed.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) == 3 and (out / "shard-00003.safetensors.partial").exists()
    with pytest.raises(ValueError, match="3 of 7 shards"):
        list(load(out))
    resumed = subprocess.run(command, env=environment, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "extract: 100%" in resumed.stderr  # the progress bar, resumed from prompt 24
    _assert_equal_to_memory(list(load(out)), extraction_saves)
