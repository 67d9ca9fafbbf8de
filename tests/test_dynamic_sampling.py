"""Dynamic sampling (generation.oversample): more groups sampled than trained, the loss gets only groups whose
rewards differ, at most training.batch_size completions, with the loss normalizer recounted."""

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

import grpo_pipeline.training.dynamic_sampling as ds
from conftest import tiny_overrides
from grpo_pipeline.config.validate import check_config
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.recipe import train
from grpo_pipeline.training.trainer import PipelineTrainer


def _out(advantages: list[float], size: int) -> dict:
    n = len(advantages)
    mask = torch.ones(n, 3, dtype=torch.long)
    mask[:, 2] = torch.arange(n) % 2  # rows of 2 or 3 loss tokens
    return {"prompt_ids": torch.arange(n)[:, None].repeat(1, 4), "completion_mask": mask,
            "advantages": torch.tensor(advantages), "num_items_in_batch": mask.sum() * 10}


def _select(advantages, size=2, keep=4):
    fake = SimpleNamespace(num_generations=size, train_completions=keep, flat_negative=0.0,
                           _metrics={"train": {"dynamic_sampling/groups_sampled": [],
                                               "dynamic_sampling/groups_trained": []}})
    return PipelineTrainer._keep_groups_with_spread(fake, _out(advantages, size)), fake._metrics["train"]


def test_keeps_groups_with_spread_in_sampling_order_up_to_the_batch():
    #            group 0 flat  | group 1 spread | group 2 flat (ulp) | group 3 spread | group 4 spread
    out, metrics = _select([0.0, 0.0, 0.7, -0.7, 1e-5, -1e-5, -1.0, 1.0, 0.5, -0.5])
    assert out["prompt_ids"][:, 0].tolist() == [2, 3, 6, 7]  # groups 1 and 3: the batch (4) is full
    assert out["advantages"].tolist() == pytest.approx([0.7, -0.7, -1.0, 1.0])
    assert out["num_items_in_batch"].item() == out["completion_mask"].sum().item() == 10
    assert metrics["dynamic_sampling/groups_sampled"] == [5.0] and metrics["dynamic_sampling/groups_trained"] == [2.0]


def test_fewer_groups_with_spread_train_a_smaller_batch_and_none_trains_one_flat_group():
    out, metrics = _select([0.0, 0.0, 0.3, -0.3, 0.0, 0.0])
    assert out["prompt_ids"][:, 0].tolist() == [2, 3]
    out, metrics = _select([0.0] * 6)
    assert out["prompt_ids"][:, 0].tolist() == [0, 1] and out["advantages"].abs().sum() == 0
    assert metrics["dynamic_sampling/groups_trained"] == [0.0]


def test_flatness_is_read_from_the_rewards_not_the_advantages():
    # dr_grpo (scale_rewards=none): rewards 1e-4 apart give advantages of 5e-5, below FLAT, yet they differ;
    # a group of identical non-dyadic rewards is flat whatever float noise its advantages carry; a group whose
    # only other completion was scored by no reward function is flat (TRL gives the unscored one advantage 0)
    advantages = [5e-5, -5e-5, 2e-3, -2e-3, 0.5, -0.5]
    fake = SimpleNamespace(num_generations=2, train_completions=4, reward_weights=torch.tensor([1.0, 1.0]),
                           args=SimpleNamespace(multi_objective_aggregation="sum_then_normalize"), flat_negative=0.0,
                           _logs={"rewards": {"a": [0.3, 0.3001, 0.1, 0.1, 0.7, float("nan")],
                                              "b": [0.0, 0.0, 0.1, 0.1, 0.0, float("nan")]}},
                           _metrics={"train": {"dynamic_sampling/groups_sampled": [],
                                               "dynamic_sampling/groups_trained": []}})
    out = PipelineTrainer._keep_groups_with_spread(fake, _out(advantages, 2))
    assert out["prompt_ids"][:, 0].tolist() == [0, 1]
    assert fake._metrics["train"]["dynamic_sampling/groups_trained"] == [1.0]
    fake._logs["rewards"] = {"a": [0.2] * 6, "b": [0.1] * 6}  # nothing differs: one group, advantages exactly 0
    out = PipelineTrainer._keep_groups_with_spread(fake, _out(advantages, 2))
    assert out["advantages"].tolist() == [0.0, 0.0] and out["prompt_ids"][:, 0].tolist() == [0, 1]


# --- negative sample reinforcement for flat groups (generation.flat_negative) -------------------------------------

def _negative_fake(rewards: list[float], flat_negative: float, scale_rewards: str = "group"):
    fake = SimpleNamespace(num_generations=2, train_completions=4, reward_weights=torch.tensor([1.0]),
                           args=SimpleNamespace(multi_objective_aggregation="sum_then_normalize"),
                           flat_negative=flat_negative, scale_rewards=scale_rewards,
                           _metrics={"train": {k: [] for k in ("dynamic_sampling/groups_sampled",
                                                               "dynamic_sampling/groups_trained",
                                                               "dynamic_sampling/groups_negative")}})
    return fake


def test_free_slots_go_to_flat_groups_below_the_step_mean_with_a_negative_advantage():
    # groups of 2: right everywhere (flat, above the mean) | spread | wrong everywhere | wrong everywhere; the batch
    # holds 2 groups: the one with spread, then the first flat group below the mean (sampling order)
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    logs = {"rewards": {"r": list(rewards)}, "advantages": [0.0, 0.0, 0.7, -0.7, 0.0, 0.0, 0.0, 0.0]}
    fake = _negative_fake(rewards, flat_negative=0.5)
    out = PipelineTrainer._keep_groups_with_spread(fake, _out(logs["advantages"], 2), None, logs)
    step = torch.tensor(rewards, dtype=torch.float64)
    expected = 0.5 * (0.0 - step.mean().item()) / (step.std().item() + 1e-4)  # -0.5 x 0.375 / 0.5176
    assert out["prompt_ids"][:, 0].tolist() == [2, 3, 4, 5]
    assert out["advantages"].tolist() == pytest.approx([0.7, -0.7, expected, expected])
    assert expected == pytest.approx(-0.3622, abs=1e-4)
    assert out["num_items_in_batch"].item() == out["completion_mask"].sum().item()
    assert logs["advantages"][4:6] == pytest.approx([expected] * 2) and logs["advantages"][6:] == [0.0, 0.0]
    metrics = fake._metrics["train"]
    assert metrics["dynamic_sampling/groups_trained"] == [1.0] and metrics["dynamic_sampling/groups_negative"] == [1.0]


def test_flat_negative_leaves_full_batches_and_groups_at_or_above_the_mean_alone():
    # two groups with spread fill the batch: the flat wrong group is not trained
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    logs = {"rewards": {"r": list(rewards)}, "advantages": [0.7, -0.7, 0.7, -0.7, 0.0, 0.0]}
    out = PipelineTrainer._keep_groups_with_spread(_negative_fake(rewards, 1.0), _out(logs["advantages"], 2),
                                                   None, logs)
    assert out["prompt_ids"][:, 0].tolist() == [0, 1, 2, 3]
    # every completion of the step scored the same: nothing is below the mean; one group with advantages 0
    rewards = [0.5] * 4
    logs = {"rewards": {"r": list(rewards)}, "advantages": [0.0] * 4}
    fake = _negative_fake(rewards, 1.0)
    out = PipelineTrainer._keep_groups_with_spread(fake, _out(logs["advantages"], 2), None, logs)
    assert out["advantages"].tolist() == [0.0, 0.0] and fake._metrics["train"]["dynamic_sampling/groups_negative"] == [0.0]
    # scale_rewards=none: reward minus the mean, not divided
    rewards = [1.0, 1.0, 0.0, 0.0]
    logs = {"rewards": {"r": list(rewards)}, "advantages": [0.0] * 4}
    out = PipelineTrainer._keep_groups_with_spread(_negative_fake(rewards, 1.0, "none"), _out([0.0] * 4, 2), None,
                                                   logs)
    assert out["prompt_ids"][:, 0].tolist() == [2, 3] and out["advantages"].tolist() == pytest.approx([-0.5, -0.5])


def test_flat_negative_needs_dynamic_sampling(compose_cfg, tmp_path):
    with pytest.raises(ConfigError, match="generation.flat_negative=0.5 fills the slots.*oversample > 1"):
        check_config(compose_cfg([*tiny_overrides(tmp_path), "generation.oversample=1",
                                  "generation.flat_negative=0.5"]))
    with pytest.raises(ConfigError, match="generation.flat_negative=-1.0: must be >= 0"):
        check_config(compose_cfg([*tiny_overrides(tmp_path), "generation.oversample=2",
                                  "generation.flat_negative=-1"]))


class HalfRightEnv:
    """Rewards differ inside some groups (a completion's length parity) and not in others (even rows)."""

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"say something {i}", "i": i} for i in range(40)])

    def score_episode(self, model, tokenizer, completion, i):
        return 0.5 if i % 2 == 0 else float(len(completion) % 2)


def test_a_run_trains_only_groups_with_spread(compose_cfg, tmp_path, monkeypatch):
    seen = []
    original = PipelineTrainer._compute_loss

    def capture(self, model, inputs):
        seen.append((inputs["advantages"].clone(), inputs["completion_mask"].sum().item(),
                     inputs["num_items_in_batch"].item()))
        return original(self, model, inputs)

    monkeypatch.setattr(PipelineTrainer, "_compute_loss", capture)
    cfg = compose_cfg([*tiny_overrides(tmp_path, env=["env=custom"]), "generation.oversample=3",
                       "generation.max_new_tokens=6", "training.max_steps=3", "tracking.enabled=false"])
    result = train(cfg, launch_dir=str(tmp_path), env=HalfRightEnv)
    assert result.steps == 3 and len(seen) == 3
    for advantages, mask_sum, normalizer in seen:
        groups = advantages.view(-1, 2)
        assert 1 <= len(groups) <= 2  # at most batch_size=4 completions of the 12 sampled
        assert normalizer == mask_sum
        if len(groups) == 2 or groups.abs().sum() > 0:
            assert (groups.abs() > ds.FLAT).any(dim=1).all()  # no flat group when one with spread exists
    assert any((a.abs() > ds.FLAT).any() for a, _, _ in seen)  # groups with spread were trained


def test_oversample_is_checked_and_off_where_groups_cannot_be_picked_locally(compose_cfg, tmp_path, monkeypatch):
    from grpo_pipeline.config.validate import fit_step

    with pytest.raises(ConfigError, match="generation.oversample=0"):
        check_config(compose_cfg([*tiny_overrides(tmp_path), "generation.oversample=0"]))
    cfg = compose_cfg([*tiny_overrides(tmp_path), "generation.oversample=2", "training.gradient_accumulation_steps=2"])
    step, said = fit_step(cfg, 100, "E")
    assert "they are off" in said and step["generation.oversample"] == 1
    assert cfg.generation.oversample == 2  # the config given is not changed (the run plan applies it to a copy)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_cfg([*tiny_overrides(tmp_path), "generation.oversample=2"])
    step, said = fit_step(cfg, 100, "E")
    assert "with 2 process(es)" in said and step["generation.oversample"] == 1


class FourRowEnv:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"say {w}", "w": w} for w in "abcd"])

    def score_episode(self, model, tokenizer, completion, w):
        return float(w in completion)


def test_a_four_row_env_trains_with_the_default_step_shape_and_says_what_it_chose(compose_cfg, tmp_path, caplog):
    # 16 completions x oversample 2 / 4 generations = 8 prompts a step, from 4 rows: TRL would train nothing
    cfg = compose_cfg([*tiny_overrides(tmp_path, env=["env=custom"]), "training.batch_size=16",
                       "generation.num_generations=4", "generation.oversample=2", "training.max_steps=3",
                       "tracking.enabled=false"])
    with caplog.at_level("WARNING"):
        result = train(cfg, launch_dir=str(tmp_path), env=FourRowEnv)
    assert result.steps == 3
    assert "FourRowEnv has 4 training prompt(s) but a step samples 8" in caplog.text
    assert "using training.batch_size=16, generation.oversample=1 (4 prompt(s) a step)" in caplog.text


def test_fit_step_shrinks_oversampling_first_then_the_batch(compose_cfg, tmp_path):
    from grpo_pipeline.config.validate import fit_step

    cfg = compose_cfg([*tiny_overrides(tmp_path), "training.batch_size=16", "generation.num_generations=4",
                       "generation.oversample=3"])

    def shape(rows):
        step, said = fit_step(cfg, rows, "E")
        return step["generation.oversample"], step["training.batch_size"], said is not None

    assert shape(12) == (3, 16, False)  # 12 prompts a step: fits
    assert shape(9) == (2, 16, True)
    assert shape(2) == (1, 8, True)


def test_fit_step_counts_gradient_accumulation_and_refuses_what_cannot_fill_a_generation(compose_cfg, tmp_path):
    from grpo_pipeline.config.validate import fit_step

    # TRL samples batch_size x gradient_accumulation_steps completions per generation: 8 x 2 / 4 = 4 prompts
    cfg = compose_cfg([*tiny_overrides(tmp_path), "training.batch_size=8", "generation.num_generations=4",
                       "generation.oversample=1", "training.gradient_accumulation_steps=2"])
    assert fit_step(cfg, 4, "E")[1] is None
    step, said = fit_step(cfg, 3, "E")  # 3 rows: one group per accumulation step = 2 prompts
    assert step["training.batch_size"] == 4 and "a step samples 4" in said
    assert "(2 prompt(s) a step over 1 process(es)" in said
    cfg = compose_cfg([*tiny_overrides(tmp_path), "training.batch_size=8", "generation.num_generations=4",
                       "generation.oversample=1", "training.gradient_accumulation_steps=4"])
    with pytest.raises(ConfigError, match=r"E has 3 training prompt\(s\), fewer than one generation needs: 4 .*"
                                          r"Lower training.gradient_accumulation_steps"):
        fit_step(cfg, 3, "E")


# --- adaptive sampling for flat groups (generation.resample_flat) ---------------------------------------------

def test_balanced_keeps_half_above_average_earliest_first_and_tops_up_from_the_other_side():
    assert ds.balanced([-0.3, -0.3, -0.3, -0.3, 2.5, -0.3, -0.3, 1.0], 4) == [0, 1, 4, 7]
    assert ds.balanced([-1.0, 3.0, -1.0, -1.0, -1.0, -1.0], 4) == [0, 1, 2, 3]  # one above: three below
    assert ds.balanced([1.0, 1.0, 1.0, -3.0, 1.0, 1.0], 4) == [0, 1, 2, 3]  # one below: three above
    assert ds.balanced([-0.5, 1.5], 2) == [0, 1]


def test_concat_outputs_pads_prompts_left_and_completions_right():
    a = {"prompt_ids": torch.tensor([[5, 6]]), "prompt_mask": torch.tensor([[1, 1]]),
         "completion_ids": torch.tensor([[7]]), "completion_mask": torch.tensor([[1]]),
         "advantages": torch.tensor([0.5]), "num_items_in_batch": torch.tensor(1)}
    b = {"prompt_ids": torch.tensor([[4, 5, 6]]), "prompt_mask": torch.tensor([[1, 1, 1]]),
         "completion_ids": torch.tensor([[8, 9]]), "completion_mask": torch.tensor([[1, 1]]),
         "advantages": torch.tensor([-0.5]), "num_items_in_batch": torch.tensor(2)}
    out = ds.concat_outputs(a, b, pad_id=0)
    assert out["prompt_ids"].tolist() == [[0, 5, 6], [4, 5, 6]] and out["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert out["completion_ids"].tolist() == [[7, 0], [8, 9]] and out["completion_mask"].tolist() == [[1, 0], [1, 1]]
    assert out["advantages"].tolist() == [0.5, -0.5] and out["num_items_in_batch"].item() == 1


def test_only_flat_groups_below_the_best_are_resampled_up_to_the_need_and_the_limit():
    # groups of 2: flat at the best | flat below | spread | flat below | flat, unscored
    totals = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.2, 0.2, None, None]
    spread = ds.spread_of_groups(totals, torch.zeros(10), 2)
    assert spread == [False, False, True, False, False]
    assert ds.flat_groups_to_resample(totals, spread, 2, need=3, limit=8) == [1, 3]
    assert ds.flat_groups_to_resample(totals, spread, 2, need=1, limit=8) == [1]
    assert ds.flat_groups_to_resample(totals, spread, 2, need=3, limit=1) == [1]
    assert ds.flat_groups_to_resample(totals, spread, 2, need=0, limit=8) == []
    assert ds.flat_groups_to_resample([None] * 4, [False, False], 2, need=2, limit=8) == []


def test_a_rescued_group_trains_a_balanced_pair_with_advantages_over_all_its_samples():
    # first round: group 0 flat at 0, group 1 spread; extra round: 2 more of group 0, one right
    totals, more = [0.0, 0.0, 1.0, 0.0], [1.0, 0.0]
    advantages = torch.tensor([0.0, 0.0, 0.7, -0.7, 0.0, 0.0])
    rows, out, rescued = ds.rescue_groups(totals, more, [0], 2, 2, advantages, "group")
    # group 0's samples: [0, 0, 1, 0]: mean 0.25, std 0.5 -> (0 - 0.25) / 0.5001, (1 - 0.25) / 0.5001
    low, high = -0.25 / 0.5001, 0.75 / 0.5001
    assert rescued == [0] and rows == [0, 4, 2, 3]  # the earliest below-average sample and the one above
    assert out.tolist() == pytest.approx([low, low, 0.7, -0.7, high, low], abs=1e-5)
    assert advantages[4].item() == 0.0  # the input is not changed
    # scale_rewards=none: not divided; an extra round that stays flat rescues nothing
    assert ds.rescue_groups(totals, more, [0], 2, 2, advantages, "none")[1][:2].tolist() == [-0.25, -0.25]
    assert ds.rescue_groups(totals, [0.0, 0.0], [0], 2, 2, advantages, "group")[::2] == ([0, 1, 2, 3], [])


def test_keep_groups_sets_negative_groups_advantages_and_zeroes_a_batch_with_nothing_to_learn():
    advantages = torch.tensor([0.0, 0.0, 0.5, -0.5, 0.0, 0.0])
    kept = ds.keep_groups(advantages, [False, True, False], 2, cap=2, negative={2: [-0.3, -0.3]})
    assert kept.rows.tolist() == [2, 3, 4, 5] and kept.advantages.tolist() == pytest.approx([0.5, -0.5, -0.3, -0.3])
    assert (kept.trained, kept.negative) == (1, 1) and advantages[4].item() == 0.0
    kept = ds.keep_groups(torch.tensor([0.2, 0.2, 0.0, 0.0]), [False, False], 2, cap=2)
    assert kept.rows.tolist() == [0, 1] and kept.advantages.tolist() == [0.0, 0.0] and kept.trained == 0


class HardOddRowsEnv:
    """Even rows: every completion right (flat at the step's best). Odd rows: the first num_generations
    completions wrong (a flat group below the best), later ones alternately right and wrong."""

    def __init__(self):
        import threading

        self.calls, self.lock = {}, threading.Lock()

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"say something {i}", "i": i} for i in range(40)])

    def score_episode(self, model, tokenizer, completion, i):
        if i % 2 == 0:
            return 1.0
        with self.lock:
            n = self.calls[i] = self.calls.get(i, 0) + 1
        return 0.0 if n <= 2 or n % 2 == 0 else 1.0


def test_flat_groups_below_the_best_are_resampled_and_trained_on_a_balanced_pair(compose_cfg, tmp_path, monkeypatch):
    seen = []
    original = PipelineTrainer._compute_loss

    def capture(self, model, inputs):
        right = [self.processing_class.decode(ids[m.bool()], skip_special_tokens=True)
                 for ids, m, a in zip(inputs["completion_ids"], inputs["completion_mask"], inputs["advantages"],
                                      strict=True) if a > 1]
        seen.append((inputs["advantages"].clone(), right, inputs["completion_mask"].sum(),
                     inputs["num_items_in_batch"].item()))
        return original(self, model, inputs)

    monkeypatch.setattr(PipelineTrainer, "_compute_loss", capture)
    env = HardOddRowsEnv()
    # a step: 4 groups of 2 sampled (oversample 2), all flat; the odd ones are below the best (1.0) and each gets
    # 2 more completions: [0, 0] + [1, 0] -> mean 0.25, std 0.5 -> advantages -0.5 (wrong), +1.5 (right)
    cfg = compose_cfg([*tiny_overrides(tmp_path, env=["env=custom"]), "generation.oversample=2",
                       "generation.resample_flat=2", "generation.max_new_tokens=4", "training.max_steps=3",
                       "loss.mask_truncated_completions=false",
                       "eval.enabled=false"])
    result = train(cfg, launch_dir=str(tmp_path), env=env)
    assert result.steps == 3 and len(seen) == 3
    import json

    from grpo_pipeline.tracking.mlflow_run import metric_history

    rows = [json.loads(x) for x in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rescued = metric_history(uri, result.mlflow_run_id, "dynamic_sampling/groups_rescued")
    assert metric_history(uri, result.mlflow_run_id, "dynamic_sampling/groups_resampled") == rescued
    assert metric_history(uri, result.mlflow_run_id, "frac_reward_zero_std") == [1.0] * 3  # the first round's alone
    for step, (advantages, right, mask_sum, normalizer) in enumerate(seen, start=1):
        episodes = [r for r in rows if r["split"] == "train" and r["step"] == step]
        odd = len({r["prompt_id"] for r in episodes if r["row"]["i"] % 2})
        assert rescued[step - 1] == min(odd, 2)  # up to the 2 groups batch_size=4 lacks
        assert len(episodes) == 8 + 2 * min(odd, 2)  # the ledger holds every episode sampled, both rounds
        if odd:
            assert sorted(advantages.tolist()) == pytest.approx(sorted([-0.5, 1.5] * min(odd, 2)), abs=1e-3)
        else:  # nothing to rescue: one flat group, trained with advantages 0
            assert advantages.abs().sum() == 0
        assert normalizer == mask_sum.item()
        # the right completions trained are the very ones sampled (and recorded) in the extra round, and the
        # ledger shows the advantage the union gave them
        resampled = [r for r in episodes if r["row"]["i"] % 2 and r["reward"] == 1.0]
        assert all(r["advantage"] == pytest.approx(1.5, abs=1e-3) for r in resampled)
        assert sorted(right) == sorted(r["completion"] for r in resampled)
    assert sum(rescued) >= 1 and all(n == 4 for n in env.calls.values())  # each hard row scored 2 + 2 times


class RightOnEvenRowsEnv:
    """Even rows: every completion right; odd rows: every completion wrong. Every group is flat."""

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"say something {i}", "i": i} for i in range(40)])

    def score_episode(self, model, tokenizer, completion, i):
        return float(i % 2 == 0)


def test_flat_negative_trains_the_wrong_flat_groups_pushed_down(compose_cfg, tmp_path, monkeypatch):
    import json

    from grpo_pipeline.tracking.mlflow_run import metric_history

    seen = []
    original = PipelineTrainer._compute_loss

    def capture(self, model, inputs):
        seen.append(inputs["advantages"].clone())
        return original(self, model, inputs)

    monkeypatch.setattr(PipelineTrainer, "_compute_loss", capture)
    cfg = compose_cfg([*tiny_overrides(tmp_path, env=["env=custom"]), "generation.oversample=2",
                       "generation.flat_negative=1.0", "generation.max_new_tokens=4", "training.max_steps=3",
                       "loss.mask_truncated_completions=false", "eval.enabled=false"])
    result = train(cfg, launch_dir=str(tmp_path), env=RightOnEvenRowsEnv())
    assert result.steps == 3 and len(seen) == 3
    rows = [json.loads(x) for x in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    negative = metric_history(uri, result.mlflow_run_id, "dynamic_sampling/groups_negative")
    for step, advantages in enumerate(seen, start=1):
        episodes = [r for r in rows if r["split"] == "train" and r["step"] == step]  # 4 groups of 2, all flat
        rewards = torch.tensor([r["reward"] for r in episodes], dtype=torch.float64)
        wrong = [r for r in episodes if r["reward"] == 0.0]
        expected = -rewards.mean().item() / (rewards.std().item() + 1e-4)
        all_wrong = len(wrong) == len(episodes)  # nothing below the step's mean: nothing to push down
        assert negative[step - 1] == (0 if all_wrong else min(len(wrong) // 2, 2))  # batch_size 4 = 2 groups of 2
        if wrong and len(wrong) < len(episodes):  # the wrong groups are trained, pushed down; the right ones not
            assert advantages.tolist() == pytest.approx([expected] * 2 * min(len(wrong) // 2, 2), abs=1e-4)
            assert all(r["advantage"] == pytest.approx(expected, abs=1e-4) for r in wrong[:4])
        assert all(r["advantage"] == 0.0 for r in episodes if r["reward"] == 1.0)
    assert sum(negative) >= 1


class FlatEnv:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"say something {i}", "i": i} for i in range(16)])

    def score_episode(self, model, tokenizer, completion, i):
        return 0.5  # every group flat: advantages 0, the policy term moves nothing


@pytest.mark.parametrize("coef", [0.0, 1.0])
def test_the_entropy_bonus_reaches_the_weights_through_the_runtime_fast_paths(compose_cfg, tmp_path, coef):
    from safetensors.torch import load_file

    cfg = compose_cfg([*tiny_overrides(tmp_path, env=["env=custom"]), f"loss.entropy_coef={coef}",
                       "training.max_steps=2", "tracking.enabled=false"])  # step 1's warm-up lr is 0
    result = train(cfg, launch_dir=str(tmp_path), env=FlatEnv)
    lora_b = [v for k, v in load_file(str(tmp_path / "run" / "model" / "adapter_model.safetensors")).items()
              if "lora_B" in k]
    moved = max(v.abs().max().item() for v in lora_b)
    assert result.steps == 2 and lora_b
    assert (moved > 0) == (coef > 0)  # LoRA's B starts at 0: only the bonus' gradient can move it here
