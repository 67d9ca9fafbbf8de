"""Held-out evaluation, usable with any env: greedy completions for prompts never trained on, scored by
the env runtime exactly as in training. Reports mean reward and success rate (share of full scores)."""

import statistics

import torch
from datasets import Dataset

from grpo_pipeline.errors import ConfigError
from grpo_pipeline.prompts import render_prompt
from grpo_pipeline.runtime.episodes import EpisodeRunner


def split_heldout(dataset: Dataset, num_prompts: int, seed: int) -> tuple[Dataset, Dataset]:
    if num_prompts >= len(dataset):
        raise ConfigError(
            f"eval.num_prompts={num_prompts} leaves nothing to train on: the env's dataset has {len(dataset)} rows. "
            "Lower eval.num_prompts or raise the env's dataset size."
        )
    split = dataset.train_test_split(test_size=num_prompts, seed=seed, shuffle=True)
    return split["train"], split["test"]


def generate(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int,
             sampling: dict | None = None) -> list[str]:
    """Completions (greedy unless `sampling` gives do_sample/temperature/...), left-padded batches,
    gradients off; the model's train mode is restored."""
    was_training = model.training
    model.eval()
    out_texts = []
    try:
        for start in range(0, len(prompts), batch_size):
            rendered = [render_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
            texts = [text for text, _ in rendered]
            inputs = tokenizer(
                texts, return_tensors="pt", padding=True, add_special_tokens=not rendered[0][1]
            ).to(model.device)
            with torch.no_grad():
                out = model.generate(
                    **inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                    **(sampling or {"do_sample": False}),
                )
            out_texts += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out_texts


def evaluate(model, tokenizer, runner: EpisodeRunner, dataset: Dataset, max_new_tokens: int, batch_size: int) -> dict:
    completions = generate(model, tokenizer, dataset["prompt"], max_new_tokens, batch_size)
    rows = [{k: dataset[i][k] for k in runner.extra_columns} for i in range(len(dataset))]
    scores, _ = runner.score(completions, rows)
    return {
        "mean_reward": statistics.fmean(scores),
        "success_rate": sum(s >= 1.0 for s in scores) / len(scores),
        "num_prompts": len(scores),
        "samples": [{"completion": c, "score": s} for c, s in list(zip(completions, scores, strict=True))[:5]],
    }
