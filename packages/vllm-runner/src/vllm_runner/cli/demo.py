"""`vllm-interp demo`: what the product does, in under two minutes on a laptop CPU.

1. Steering: a direction from contrastive prompts (the mean last-token residual of happy
   sentences minus that of sad ones), then generations with and without it, side by side.
2. A logit lens: every layer's residual stream through the final norm and unembedding, inside
   the engine; the top token per layer and position, as a table and a heatmap.
3. An attention pattern of one head, as a figure.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams

from vllm_runner import ops

HAPPY = ["I love this, it is wonderful.", "What a beautiful, joyful day.",
         "This is the best news, I am thrilled.", "Everything went perfectly, I am so happy."]
SAD = ["I hate this, it is awful.", "What a miserable, gloomy day.",
       "This is the worst news, I am devastated.", "Everything went wrong, I am so sad."]
# Chosen by reading what the embedded model writes at several layers and strengths: these show
# the contrast plainly at layer 10 and strength 4 (stronger steering turns into repetition).
STEERED_PROMPTS = ["When I think about tomorrow, I feel", "I opened the letter and"]
LENS_PROMPT = "The capital of France is Paris, and the capital of Italy is"


def run_demo(llm: Any, out: Path, steer_layer: float = 0.33, strength: float = 4.0) -> Path:
    """Run the three parts on `llm`, print the results, write the figures to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = llm.get_tokenizer()
    layer = max(0, min(llm.num_layers - 1, round(steer_layer * llm.num_layers)))
    _steering(llm, layer, strength)
    tokens, probabilities, labels = _logit_lens(llm, tokenizer)
    figures = [_plot_lens(tokens, probabilities, labels, tokenizer, out / "logit_lens.png"),
               _plot_pattern(llm, tokenizer, out / "attention_pattern.png")]
    print("\nFigures:")
    for figure in figures:
        print(f"  {figure.resolve()}")
    return out


def _steering(llm: Any, layer: int, strength: float) -> None:
    location = f"layers.{layer}.layer_output"
    params = SamplingParams(max_tokens=1, temperature=0.0)
    outputs = llm.generate(HAPPY + SAD, params,
                           interventions=[ops.Save(location, positions=(-1,))], use_tqdm=False)
    last = torch.stack([output.saved[location][0, -1] for output in outputs])
    direction = last[: len(HAPPY)].mean(0) - last[len(HAPPY):].mean(0)
    # Scaled to the stream's own size, so the strength means the same on any model.
    vector = direction / direction.norm() * last.norm(dim=-1).mean() * strength / 10
    print(f"1. Steering at {location} (happy minus sad, strength {strength})\n")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    for prompt in STEERED_PROMPTS:
        plain, towards, away = llm.generate(
            [prompt] * 3, params,
            interventions=[[], [ops.Add(location, vector)], [ops.Add(location, -vector)]],
            use_tqdm=False)
        print(f"  prompt: {prompt!r}")
        for name, output in (("plain", plain), ("+happy", towards), ("-happy", away)):
            text = " ".join(output.outputs[0].text.split())
            print(textwrap.fill(text, width=96, initial_indent=f"    {name:>7}: ",
                                subsequent_indent=" " * 13))
        print()


def _logit_lens(llm: Any, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    locations = [f"layers.{i}.layer_output" for i in range(llm.num_layers)]
    (output,) = llm.generate([LENS_PROMPT], SamplingParams(max_tokens=1, temperature=0.0),
                             interventions=[ops.Lens(loc, top_k=1) for loc in locations],
                             use_tqdm=False)
    tokens = torch.stack([output.saved[f"{loc}.lens_tokens"][0, :, 0] for loc in locations])
    probabilities = torch.stack([output.saved[f"{loc}.lens_probs"][0, :, 0]
                                 for loc in locations])
    labels = [tokenizer.decode([token]) for token in output.prompt_token_ids]
    shown = range(max(0, len(labels) - 6), len(labels))
    print(f"2. Logit lens on {LENS_PROMPT!r}: the top next token at each layer\n")
    print("  layer " + "".join(f"{_short(labels[p]):>12}" for p in shown))
    for index in range(len(locations)):
        cells = "".join(f"{_short(tokenizer.decode([int(tokens[index, p])])):>12}"
                        for p in shown)
        print(f"  {index:>5} {cells}")
    answer = output.outputs[0].text
    print(f"\n  the model continues with {answer!r}\n")
    return tokens, probabilities, labels


def _short(text: str) -> str:
    return repr(text.strip() or text)[1:-1][:10]


def _pyplot():
    """matplotlib's pyplot drawing to files (no screen needed), imported only for the figures."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def _plot_lens(tokens: torch.Tensor, probabilities: torch.Tensor, labels: list[str],
               tokenizer: Any, path: Path) -> Path:
    pyplot = _pyplot()
    layers, positions = probabilities.shape
    figure, axes = pyplot.subplots(figsize=(1.1 * positions + 2, 0.32 * layers + 1.5))
    image = axes.imshow(probabilities.float().numpy(), aspect="auto", cmap="viridis", vmin=0,
                        vmax=1)
    for layer in range(layers):
        for position in range(positions):
            text = _short(tokenizer.decode([int(tokens[layer, position])]))
            shade = "black" if probabilities[layer, position] > 0.6 else "white"
            axes.text(position, layer, text, ha="center", va="center", fontsize=6, color=shade)
    axes.set_xticks(range(positions), [_short(label) for label in labels], rotation=45,
                    ha="right", fontsize=7)
    axes.set_ylabel("layer")
    axes.set_title("Logit lens: top next token and its probability at each layer")
    figure.colorbar(image, ax=axes, label="probability")
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    pyplot.close(figure)
    return path


def _plot_pattern(llm: Any, tokenizer: Any, path: Path, head: int = 0) -> Path:
    pyplot = _pyplot()
    layer = llm.num_layers // 2
    location = f"layers.{layer}.self_attn.attention_probabilities"
    (output,) = llm.generate([LENS_PROMPT], SamplingParams(max_tokens=1, temperature=0.0),
                             interventions=[ops.Save(location)], use_tqdm=False)
    pattern = output.saved[location][0, head].float()
    labels = [_short(tokenizer.decode([token])) for token in output.prompt_token_ids]
    figure, axes = pyplot.subplots(figsize=(0.35 * len(labels) + 2.5, 0.35 * len(labels) + 2))
    image = axes.imshow(pattern.numpy(), cmap="magma", vmin=0)
    axes.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    axes.set_yticks(range(len(labels)), labels, fontsize=7)
    axes.set_xlabel("key")
    axes.set_ylabel("query")
    axes.set_title(f"Attention pattern, layer {layer}, head {head}")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    pyplot.close(figure)
    return path
