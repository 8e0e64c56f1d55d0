"""`llm.chat` takes `interventions`: the conversation is rendered to the same tokens vLLM's own
`chat` gives, and the program runs on them as in `generate`."""

from __future__ import annotations

import pytest
import torch
from conftest import same_logprobs
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]


def test_chat_runs_programs_on_vllms_own_rendering(llm) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    (plain,) = llm.engine.chat(CONVERSATION, params, use_tqdm=False)  # vLLM's own chat
    (ours,) = llm.chat(CONVERSATION, params, [ops.Save("layers.1.layer_output")],
                       use_tqdm=False)
    assert ours.prompt_token_ids == plain.prompt_token_ids
    assert ours.prompt == plain.prompt  # the rendered text, as vLLM gives it
    assert list(ours.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    (direct,) = llm.generate([TokensPrompt(prompt_token_ids=plain.prompt_token_ids)], params,
                             [ops.Save("layers.1.layer_output")], use_tqdm=False)
    assert torch.equal(ours.saved["layers.1.layer_output"], direct.saved["layers.1.layer_output"])
    assert ours.saved["layers.1.layer_output"].shape[1] == len(plain.prompt_token_ids) + 2


def test_chat_takes_a_list_of_conversations_with_one_program_each(llm) -> None:
    steer = torch.randn(128, generator=torch.Generator().manual_seed(3)) * 4
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=0)
    steered, plain = llm.chat([CONVERSATION, CONVERSATION], params,
                              [[ops.Add("layers.0.layer_output", steer)], []], use_tqdm=False)
    (alone,) = llm.engine.chat(CONVERSATION, params, use_tqdm=False)
    assert same_logprobs(plain, alone)
    assert not same_logprobs(steered, alone)


def test_chat_uses_the_template_the_engine_loaded_and_named_arguments_win(llm,
                                                                         monkeypatch) -> None:
    # `LLM(chat_template=...)` is kept on vLLM's LLM; its own chat renders with it.
    monkeypatch.setattr(llm.engine, "chat_template",
                        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}|"
                        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    params = SamplingParams(max_tokens=2, temperature=0.0)
    options = {"chat_template_kwargs": {"add_generation_prompt": False}, "use_tqdm": False}
    (plain,) = llm.engine.chat(CONVERSATION, params, **options)
    (ours,) = llm.chat(CONVERSATION, params, [ops.Save("layers.0.layer_output")], **options)
    assert plain.prompt.startswith("[system] Be brief.|") and plain.prompt.endswith("[assistant]")
    assert ours.prompt_token_ids == plain.prompt_token_ids


def test_chat_without_interventions_is_vllms_own(llm) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    (plain,) = llm.engine.chat(parts, params, use_tqdm=False)
    (ours,) = llm.chat(parts, params, use_tqdm=False)
    assert ours.prompt_token_ids == plain.prompt_token_ids and ours.saved == {}
    assert ours.error is None
    with pytest.raises(TypeError, match="content of a 'user' message is a list"):
        llm.chat(parts, params, [ops.Save("layers.0.layer_output")], use_tqdm=False)


def test_chat_renders_unset_arguments_and_empty_contents_as_vllm_does(llm, monkeypatch) -> None:
    # `tools` left unset must not hide the tools given in chat_template_kwargs, and a message
    # without content (an assistant's tool call) renders as vLLM renders it.
    monkeypatch.setattr(llm.engine, "chat_template",
                        "{{ tools }}|{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                        "{% endfor %}")
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                    {"role": "user", "content": "Again"}]
    tools = [{"type": "function", "function": {"name": "colour", "parameters": {}}}]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    options = {"chat_template_kwargs": {"tools": tools}, "use_tqdm": False}
    (plain,) = llm.engine.chat(conversation, params, **options)
    (ours,) = llm.chat(conversation, params, [ops.Save("layers.0.layer_output")], **options)
    assert "colour" in plain.prompt and "None" not in plain.prompt
    assert ours.prompt == plain.prompt and ours.prompt_token_ids == plain.prompt_token_ids
