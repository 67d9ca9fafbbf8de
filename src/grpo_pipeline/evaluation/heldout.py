"""Held-out evaluation, usable with any env: greedy completions for prompts never trained on, scored by
the env runtime exactly as in training: by the env's score (eval.reward=env), or by the total reward training
sums (eval.reward=total: rewards/total.py). Reports mean reward and success rate (share of full scores).

The split is by unique prompt, not by row: rows with the same prompt (or, when the env names columns in
`heldout_group_by`, the same value there) stay on one side, so no held-out prompt is ever trained on. An env
whose prompts do not name the task (`prompt_is_task = False`: a TRL env whose reset() writes it into an empty
prompt) is split by its `heldout_group_by` columns alone.
"""

import contextlib
import json
import logging
import statistics
from dataclasses import dataclass

import torch
from datasets import Dataset

from grpo_pipeline.config.schema import EvalConfig
from grpo_pipeline.envs.runner import GREEDY, EpisodeRunner
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.prompts import render_prompt

log = logging.getLogger(__name__)
# a test set of 50 prompts misjudged the default run's gain: its base score was 0.528, 0.430 on 400 fresh sums
# (docs/results.md); 200 measure a gain to a paired standard error of ~0.03
AUTO_SHARE, AUTO_MAX_TEST, AUTO_MAX_VAL, MIN_SET = 0.1, 200, 32, 5


@dataclass
class Split:
    train: Dataset
    test: Dataset | None  # scored before and after training
    val: Dataset | None  # scored during training; picks the best model


def prompt_groups(dataset: Dataset, group_by: list[str], by_prompt: bool = True) -> list[list[int]]:
    """Row indices grouped so that rows sharing a prompt (with `by_prompt`), or a value of a `group_by` column,
    are together."""
    parent = list(range(len(dataset)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict = {}
    for column in ["prompt"] * by_prompt + group_by:
        for i, value in enumerate(dataset[column]):
            key = (column, json.dumps(value, sort_keys=True, default=str))
            if key in first:
                parent[find(i)] = find(first[key])
            else:
                first[key] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(dataset)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _size(asked: int | None, groups: int, cap: int) -> int:
    if asked is not None:
        return asked
    n = min(cap, int(groups * AUTO_SHARE))
    return n if n >= MIN_SET else 0


def split_heldout(dataset: Dataset, cfg: EvalConfig, env_name: str, group_by: list[str] | None = None,
                  by_prompt: bool = True) -> Split:
    """Test / validation / training sets of unique prompts (seed `cfg.split_seed`)."""
    for column in group_by or []:
        if column not in dataset.column_names:
            raise ConfigError(f"{env_name}.heldout_group_by names column {column!r}, which its dataset lacks "
                              f"(columns: {dataset.column_names}).")
    groups = prompt_groups(dataset, group_by or [], by_prompt)
    n_test = _size(cfg.num_prompts, len(groups), AUTO_MAX_TEST)
    # an explicit val_prompts is held out even without validation, so both runs train on the same prompts
    n_val = _size(cfg.val_prompts, len(groups), AUTO_MAX_VAL) if cfg.every_steps > 0 or cfg.val_prompts else 0
    if n_test + n_val >= len(groups):
        asked = [f"eval.{k}={v}" for k, v in (("num_prompts", cfg.num_prompts), ("val_prompts", cfg.val_prompts))
                 if v is not None]
        raise ConfigError(f"{' and '.join(asked)} leave(s) nothing to train on: {env_name}'s dataset has "
                          f"{len(groups)} unique prompts. Lower them, or leave them null to size them from the data.")
    auto_test, auto_val = cfg.num_prompts is None, cfg.every_steps > 0 and cfg.val_prompts is None
    if (auto_test and n_test < AUTO_MAX_TEST) or (auto_val and n_val < AUTO_MAX_VAL):  # the data limited them
        if n_test == 0 and n_val == 0:
            log.warning("eval: %s's dataset has %d unique prompts; a %d%% held-out set would have fewer than %d, "
                        "so none is held out and held-out evaluation is off. Set eval.num_prompts=N to hold out N.",
                        env_name, len(groups), int(AUTO_SHARE * 100), MIN_SET)
        else:
            log.warning("eval: held out %d test and %d validation prompts of %d unique ones (10%% each, at most %d "
                        "and %d; set eval.num_prompts / eval.val_prompts to choose).", n_test, n_val, len(groups),
                        AUTO_MAX_TEST, AUTO_MAX_VAL)
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(cfg.split_seed)).tolist()
    test_groups, val_groups = order[:n_test], order[n_test : n_test + n_val]
    train_rows = sorted(i for g in order[n_test + n_val :] for i in groups[g])

    def one_row_each(chosen):  # a held-out prompt counts once, however many rows repeat it
        return dataset.select([groups[g][0] for g in chosen]) if chosen else None

    return Split(dataset.select(train_rows), one_row_each(test_groups), one_row_each(val_groups))


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


def evaluate(model, tokenizer, runner: EpisodeRunner, dataset: Dataset, max_new_tokens: int, batch_size: int,
             rollout=None, cap_turn_tokens: int | None = None, total=None, kl=None) -> dict:
    """Greedy episodes over `dataset`, generated like training's (through `rollout`, when the run has one),
    scored by the env's score, or with `total` (rewards/total.py, eval.reward=total) by the reward training sums;
    with `kl` (evaluation/kl_to_base.py), also the policy's KL to the base model over these completions.
    The RNG states are left as they were, so evaluating does not change a seeded run's training trajectory."""
    rows = [{k: dataset[i][k] for k in runner.extra_columns} for i in range(len(dataset))]
    prompts = dataset["prompt"]
    with preserved_rng():
        pre_failures, trajs = None, None
        if rollout is None:
            completions = episodes = generate(model, tokenizer, prompts, max_new_tokens, batch_size)
        else:
            trajs = [t for start in range(0, len(prompts), batch_size)
                     for t in rollout.run(model, prompts[start : start + batch_size], rows[start : start + batch_size],
                                          GREEDY, turn_tokens=cap_turn_tokens)]
            completions = episodes = [t.text for t in trajs]
            if rollout.multi_turn:  # score_episode gets the whole episode's messages
                episodes, pre_failures = [t.messages for t in trajs], [t.failure for t in trajs]
            if rollout.stateful:  # each episode's own opening (a TRL env's reset() text appended), for the ledger
                prompts = [t.prompt for t in trajs]
        scores, metrics = runner.score(episodes, rows, evaluation=True, pre_failures=pre_failures)
        batch = runner.last_batch
        parts, totals, full = {"env": scores}, None, 1.0
        if total is not None:
            parts, totals = total(prompts, completions, rows, scores, batch["failures"])
            scores, full = totals, total.full
        kl_to_base = kl(_token_ids(tokenizer, prompts, completions, trajs)) if kl is not None else None
    return {
        "episodes": {"prompts": list(prompts), "completions": episodes, "rewards": parts, "totals": totals,
                     "rows": rows, "seconds": batch["seconds"], "failures": batch["failures"]},  # for the ledger
        "reward": "total" if total is not None else "env",  # what the scores are (eval.reward)
        "scores": scores,  # per prompt, in the dataset's order (paired_gain); not kept in summary.json
        "mean_reward": statistics.fmean(scores),
        "success_rate": sum(s >= full - 1e-9 for s in scores) / len(scores),  # every part at its full score
        "num_prompts": len(scores),
        "failures": int(metrics.get("eval/failures", 0)),
        "samples": [{"completion": c, "score": s} for c, s in list(zip(completions, scores, strict=True))[:5]],
    } | ({"kl_to_base": kl_to_base} if kl_to_base is not None else {})


def _token_ids(tokenizer, prompts: list, completions: list[str], trajs) -> list[tuple[list, list, list]]:
    """(prompt ids, completion ids, 1 where the model generated the token) per episode: the rollout's own ids, or
    (TRL generated) the rendered prompt and the completion tokenized again."""
    if trajs is not None:
        return [(t.prompt_ids, t.completion_ids, t.env_mask or [1] * len(t.completion_ids)) for t in trajs]
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text, chat = render_prompt(tokenizer, prompt)
        prompt_ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        out.append((prompt_ids, completion_ids, [1] * len(completion_ids)))
    return out


@contextlib.contextmanager
def preserved_rng():
    """Restore torch's (CPU and CUDA: torch.random.fork_rng), Python's and NumPy's RNG states on exit."""
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng():
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float | None]:
    """The mean per-prompt change of score from `before` to `after` (the same prompts, in the same order), and its
    standard error (None for a single prompt): a gain measured on few prompts is a rough estimate, and this says
    how rough."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired_gain needs the same prompts scored twice, got {len(before)} and {len(after)} scores")
    diffs = [a - b for b, a in zip(before, after, strict=True)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
    return statistics.fmean(diffs), se
