"""Honest held-out sets (split by unique prompt, sized to the data) and validation during training: the best
step's weights are what model/ holds, evaluation does not change a seeded run's trajectory, early stop."""

import json
import logging
import statistics
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

import grpo_pipeline.recipe as recipe
from conftest import tiny_overrides
from grpo_pipeline.config.schema import EvalConfig
from grpo_pipeline.envs.arithmetic import ArithmeticEnv
from grpo_pipeline.envs.hotel import HotelEnv
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.evaluation.best_model import trainable_state
from grpo_pipeline.evaluation.heldout import paired_gain, split_heldout
from grpo_pipeline.models import build_tiny_tokenizer


def _prompts(ds) -> set[str]:
    return {json.dumps(p, sort_keys=True) for p in ds["prompt"]} if ds is not None else set()


@pytest.mark.parametrize("env", [ArithmeticEnv(), HotelEnv(), ArithmeticEnv(num_samples=150, max_value=19)],
                         ids=["arithmetic", "hotel", "arithmetic-with-repeats"])
def test_no_held_out_prompt_is_trained_on_for_every_shipped_env(env):
    dataset = env.build_dataset(build_tiny_tokenizer())
    split = split_heldout(dataset, EvalConfig(enabled=True, every_steps=5), type(env).__name__)
    train, val, test = _prompts(split.train), _prompts(split.val), _prompts(split.test)
    assert test and val and train
    assert not (train & test) and not (train & val) and not (val & test)
    assert len(split.test) == len(test) and len(split.val) == len(val)  # each held-out prompt once
    assert len(train | val | test) == len(_prompts(dataset))  # nothing lost


def test_rows_sharing_a_named_column_stay_on_one_side():
    rows = [{"prompt": f"Q{i}", "template": i % 7} for i in range(140)]
    split = split_heldout(Dataset.from_list(rows), EvalConfig(enabled=True, num_prompts=1), "Env", ["template"])
    held = set(split.test["template"])
    assert len(held) == 1 and not held & set(split.train["template"])


def test_a_tiny_env_gets_no_held_out_set_and_says_so(caplog):
    dataset = Dataset.from_list([{"prompt": f"Say {i}"} for i in range(4)])
    with caplog.at_level(logging.WARNING):
        split = split_heldout(dataset, EvalConfig(enabled=True), "TinyEnv")
    assert split.test is None and split.val is None and len(split.train) == 4
    assert "TinyEnv's dataset has 4 unique prompts" in caplog.text and "eval.num_prompts=N" in caplog.text


def test_an_explicit_size_that_leaves_nothing_to_train_is_an_error():
    dataset = Dataset.from_list([{"prompt": f"Say {i % 3}"} for i in range(30)])  # 3 unique prompts
    with pytest.raises(ConfigError, match=r"eval.num_prompts=3 leave\(s\) nothing to train on: .* 3 unique prompts"):
        split_heldout(dataset, EvalConfig(enabled=True, num_prompts=3), "Env")


def test_a_first_run_on_a_four_row_env_trains(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "four.py").write_text(
        "from datasets import Dataset\nclass Four:\n    def build_dataset(self, tokenizer):\n"
        "        return Dataset.from_list([{'prompt': f'Say {i}'} for i in range(4)])\n"
        "    def score_episode(self, model, tokenizer, completion):\n        return 0.5\n")
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=four.Four"]), "eval.enabled=true"])
    result = recipe.train(cfg, launch_dir=str(tmp_path))
    assert result.steps == 2 and result.eval_before is None and result.num_samples == 4


class ScriptedValidation:
    """Replaces evaluate(): scripted validation scores (one for every prompt, or a list per prompt), and a copy
    of the weights at each validation."""

    def __init__(self, scores):
        self.scores, self.weights, self.real = list(scores), [], recipe.evaluate

    def __call__(self, model, tokenizer, runner, dataset, *args, **kwargs):
        result = self.real(model, tokenizer, runner, dataset, *args, **kwargs)
        if len(dataset) == 5:  # the validation set (val_prompts=5); the test set has 4
            self.weights.append(trainable_state(model))
            score = self.scores.pop(0)
            result["scores"] = score if isinstance(score, list) else [score] * 5
            result["mean_reward"] = statistics.fmean(result["scores"])
        return result


class VariedEnv:
    """Scores that vary within a group, so every step moves the weights."""

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Count to {i}"} for i in range(60)])

    def score_episode(self, model, tokenizer, completion):
        return (len(completion) % 7) / 6


def _validated(tmp_path, *extra):
    return [*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "eval.enabled=true", "eval.num_prompts=4",
            "eval.val_prompts=5", "eval.every_steps=1", "training.max_steps=3", "training.learning_rate=0.05",
            "loss=grpo", *extra]  # not dapo: it masks the truncated completions, which are all of the tiny model's


def test_model_holds_the_best_validation_steps_weights_and_model_last_the_last(compose_cfg, tmp_path, monkeypatch):
    scripted = ScriptedValidation([0.1, 0.6, 0.3])
    monkeypatch.setattr(recipe, "evaluate", scripted)
    result = recipe.train(compose_cfg(_validated(tmp_path)), launch_dir=str(tmp_path), env=VariedEnv())

    assert (result.best_step, result.best_val, result.last_step, result.last_val) == (2, 0.6, 3, 0.3)
    best, last = scripted.weights[1], scripted.weights[2]
    saved = load_file(str(Path(result.model_path) / "adapter_model.safetensors"))
    saved_last = load_file(str(tmp_path / "run" / "model-last" / "adapter_model.safetensors"))
    assert len(saved) == len(best) > 0

    def same(saved_tensors, reference):  # PEFT drops the adapter name from the saved keys
        return all(torch.equal(saved_tensors[k.replace(".default", "")], v) for k, v in reference.items())

    assert same(saved, best) and not same(saved, last) and same(saved_last, last)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["best_step"] == summary["model_step"] == 2
    assert summary["validation"] == [[1, 0.1], [2, 0.6], [3, 0.3]]
    assert list((tmp_path / "run" / "best").iterdir()) == [tmp_path / "run" / "best" / "step-2.safetensors"]


@pytest.mark.parametrize("margin", [2.0, 0.0])
def test_a_best_step_within_the_margin_of_the_last_leaves_model_the_last_weights(compose_cfg, tmp_path, monkeypatch,
                                                                                 margin):
    # step 2 scores 0.6, step 3 (the last) 0.4; per prompt step 2 - step 3 is [0, 1, -1, 0, 1]: +0.2 +- 0.374,
    # inside 2 standard errors: model/ keeps the last step's weights; with margin 0 the best step's
    scripted = ScriptedValidation([0.0, [1.0, 1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0, 0.0]])
    monkeypatch.setattr(recipe, "evaluate", scripted)
    result = recipe.train(compose_cfg(_validated(tmp_path, f"eval.best_margin={margin}")), launch_dir=str(tmp_path),
                          env=VariedEnv())
    kept = 3 if margin else 2
    assert (result.best_step, result.best_val, result.last_step, result.model_step) == (2, 0.6, 3, kept)
    saved = load_file(str(Path(result.model_path) / "adapter_model.safetensors"))
    assert all(torch.equal(saved[k.replace(".default", "")], v) for k, v in scripted.weights[kept - 1].items())
    assert not all(torch.equal(saved[k.replace(".default", "")], v) for k, v in scripted.weights[4 - kept].items())
    assert [p.name for p in (tmp_path / "run" / "best").iterdir()] == ["step-2.safetensors"]  # the best step's
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["model_step"] == kept


def test_a_resumed_run_reports_its_gain_against_the_first_starts_test_scores(compose_cfg, tmp_path):
    from grpo_pipeline.tracking.ledger import read

    overrides = [*_validated(tmp_path), "training.save_steps=1"]
    first = recipe.train(compose_cfg([*overrides, "training.max_steps=1"]), launch_dir=str(tmp_path), env=VariedEnv())
    resumed = recipe.train(compose_cfg([*overrides, "training.max_steps=2", f"resume={tmp_path / 'run'}"]),
                           launch_dir=str(tmp_path), env=VariedEnv())
    assert first.eval_before is not None and resumed.eval_before is None  # not scored again on resume
    entries = read(tmp_path / "run" / "episodes.jsonl")
    before = {e["prompt_id"]: e["reward"] for e in entries if e["split"] == "test_before"}
    after = [e for e in entries if e["split"] == "test_after"]
    assert len(before) == len(after) == 4  # the first start's test_after was dropped on resume
    changes = [e["reward"] - before[e["prompt_id"]] for e in after]
    gain, se = paired_gain([before[e["prompt_id"]] for e in after], [e["reward"] for e in after])
    assert resumed.eval_after["gain"] == pytest.approx(statistics.fmean(changes), abs=1e-4)
    assert resumed.eval_after["gain"] == pytest.approx(gain, abs=1e-4)
    assert resumed.eval_after["gain_se"] == pytest.approx(se, abs=1e-4)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_after"]["gain"] == resumed.eval_after["gain"]


def test_early_stop_after_patience_validations_without_improvement(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(recipe, "evaluate", ScriptedValidation([0.5, 0.4, 0.3, 0.2, 0.1, 0.0]))
    result = recipe.train(compose_cfg(_validated(tmp_path, "training.max_steps=6", "eval.early_stop_patience=2")),
                          launch_dir=str(tmp_path), env=VariedEnv())
    assert result.steps == 3 and result.stopped_early and result.best_step == 1


def test_validation_does_not_change_the_training_trajectory(compose_cfg, tmp_path):
    curves = []
    for every in (0, 1):
        out = tmp_path / f"every{every}"
        cfg = compose_cfg([*tiny_overrides(out, ["env=custom", "env._target_=unused.Env"]), "eval.enabled=true",
                           "eval.num_prompts=4", "eval.val_prompts=5", f"eval.every_steps={every}",
                           "training.max_steps=4", "training.learning_rate=0.05", "loss=grpo"])
        result = recipe.train(cfg, launch_dir=str(out), env=VariedEnv())
        curves.append((result.rewards, load_file(str(Path(result.model_path) / "adapter_model.safetensors"))))
        if every:
            assert len(result.validation) == 4 and result.eval_seconds > 0
    assert curves[0][0] == curves[1][0]
    # the last weights are the same (with validation, model/ holds the best step's: compare model-last)
    last = load_file(str(tmp_path / "every1" / "run" / "model-last" / "adapter_model.safetensors"))
    assert all(torch.equal(curves[0][1][k], last[k]) for k in last)


def test_paired_gain_is_the_mean_per_prompt_change_with_its_standard_error():
    gain, se = paired_gain([0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.5])  # changes 1, 0, 0, -0.5
    assert gain == pytest.approx(0.125) and se == pytest.approx((1.1875 / 3) ** 0.5 / 2)
    assert paired_gain([0.2, 0.4], [0.4, 0.6]) == pytest.approx((0.2, 0.0))  # the same change everywhere: no doubt
    assert paired_gain([0.5], [1.0]) == (0.5, None)  # one prompt: no error to estimate
    with pytest.raises(ValueError, match="the same prompts scored twice, got 2 and 3"):
        paired_gain([0.1, 0.2], [0.1, 0.2, 0.3])


def test_the_automatic_test_set_grows_with_the_data_up_to_200_prompts():
    def sizes(n):
        split = split_heldout(Dataset.from_list([{"prompt": f"Q{i}"} for i in range(n)]),
                              EvalConfig(enabled=True, every_steps=5), "Env")
        return len(split.test), len(split.val), len(split.train)

    assert sizes(600) == (60, 32, 508) and sizes(2500) == (200, 32, 2268)
    env = ArithmeticEnv()  # the default run's env: 2000 distinct sums, 200 of them the test set
    assert len(set(map(str, env.build_dataset(build_tiny_tokenizer())["prompt"]))) == 2000


class ScriptedTest(ScriptedValidation):
    """Replaces evaluate(): the test set's per-prompt scores, before then after training, from a script."""

    def __init__(self, before, after):
        super().__init__([])
        self.tests = [list(before), list(after)]

    def __call__(self, model, tokenizer, runner, dataset, *args, **kwargs):
        result = self.real(model, tokenizer, runner, dataset, *args, **kwargs)
        if len(dataset) == 4:  # the test set (eval.num_prompts=4)
            result["scores"] = self.tests.pop(0)
            result["mean_reward"] = sum(result["scores"]) / 4
        return result


def test_the_held_out_gain_and_its_standard_error_reach_the_summary_and_mlflow(compose_cfg, tmp_path, monkeypatch):
    before, after = [0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.5]
    monkeypatch.setattr(recipe, "evaluate", ScriptedTest(before, after))
    result = recipe.train(compose_cfg(_validated(tmp_path, "eval.every_steps=0", "training.max_steps=1")),
                          launch_dir=str(tmp_path), env=VariedEnv())
    gain, se = paired_gain(before, after)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_after"]["gain"] == pytest.approx(gain, abs=1e-4) == result.eval_after["gain"]
    assert summary["eval_after"]["gain_se"] == pytest.approx(se, abs=1e-4) and se > 0
    assert "scores" not in summary["eval_before"] and "scores" not in summary["eval_after"]  # per prompt: the ledger's
    from grpo_pipeline.tracking.mlflow_run import metric_history

    logged = metric_history(f"sqlite:///{tmp_path}/mlflow.db", result.mlflow_run_id, "eval_after/gain_se")
    assert logged == [pytest.approx(se, abs=1e-4)]


def test_a_max_minutes_stop_between_validations_reports_the_step_of_the_weights_it_saved(compose_cfg, tmp_path,
                                                                                        monkeypatch):
    class TimeUpAtStep3(recipe.StopControl):  # training.max_minutes runs out during step 3 (no clock in a test)
        def on_step_end(self, args, state, control, **kwargs):
            self.deadline = 0.0 if state.global_step >= 3 else None
            return super().on_step_end(args, state, control, **kwargs)

    scripted = ScriptedValidation([0.3, 0.6])  # step 2, then the live weights of step 3 at the stop
    monkeypatch.setattr(recipe, "evaluate", scripted)
    monkeypatch.setattr(recipe, "StopControl", TimeUpAtStep3)
    result = recipe.train(compose_cfg(_validated(tmp_path, "training.max_steps=6", "eval.every_steps=2",
                                                 "training.max_minutes=60")),
                          launch_dir=str(tmp_path), env=VariedEnv())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.steps == 3 and result.stopped_early
    assert summary["validation"] == [[2, 0.3], [3, 0.6]]  # the stop's weights were validated
    assert summary["model_step"] == summary["last_step"] == 3  # and they are what model/ holds
    saved = load_file(str(Path(result.model_path) / "adapter_model.safetensors"))
    assert all(torch.equal(saved[k.replace(".default", "")], v) for k, v in scripted.weights[1].items())
