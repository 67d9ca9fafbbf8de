"""Monitoring users already have: tracking.report_to (TensorBoard, wandb) beside MLflow."""

import json
import os
import sys

import pytest

from conftest import tiny_overrides
from grpo_pipeline.config.grpo_args import grpo_kwargs
from grpo_pipeline.config.validate import check_config
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.recipe import train


def test_report_to_tensorboard_writes_the_reward_curve_under_the_run_dir(compose_cfg, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose_cfg([*tiny_overrides(tmp_path), "tracking.report_to=[tensorboard]"])
    result = train(cfg, launch_dir=str(tmp_path))
    logdir = tmp_path / "run" / "tensorboard"
    assert list(logdir.glob("events.out.tfevents.*")), list((tmp_path / "run").rglob("*tfevents*"))
    events = EventAccumulator(str(logdir))
    events.Reload()
    rewards = events.Scalars("train/reward")
    assert [e.step for e in rewards] == [1, 2]
    assert [pytest.approx(e.value, abs=1e-6) for e in rewards] == result.rewards
    assert "train/loss" in events.Tags()["scalars"]


def test_report_to_wandb_runs_offline_in_the_run_dir(compose_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # not a dependency: checked where it is installed
    for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    train(compose_cfg([*tiny_overrides(tmp_path), "tracking.report_to=[wandb]"]), launch_dir=str(tmp_path))
    (offline,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    assert next(offline.glob("run-*.wandb")).stat().st_size > 0
    assert "WANDB_MODE" not in os.environ and "WANDB_DIR" not in os.environ  # set only while wandb started


def test_report_to_reaches_transformers_and_never_names_mlflow(compose_cfg, tmp_path):
    cfg = compose_cfg(["model=tiny", f"output_dir={tmp_path}", "tracking.report_to=[tensorboard,wandb]"])
    assert grpo_kwargs(cfg, str(tmp_path))["report_to"] == ["tensorboard", "wandb"]
    assert grpo_kwargs(compose_cfg(["model=tiny", f"output_dir={tmp_path}"]), str(tmp_path))["report_to"] == "none"
    with pytest.raises(Exception) as e:  # MLflow is the pipeline's own store: not logged twice
        compose_cfg(["model=tiny", f"output_dir={tmp_path}", "tracking.report_to=[mlflow]"])
    assert "Invalid value 'mlflow', expected one of [tensorboard, wandb]" in str(e.value.__cause__)


def test_report_to_wandb_without_wandb_is_a_config_error(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, whatever this machine has
    cfg = compose_cfg(["model=tiny", f"output_dir={tmp_path}", "tracking.report_to=[wandb]"])
    with pytest.raises(ConfigError, match=r"tracking\.report_to=\['wandb'\]: wandb is not installed.*pip install wandb"):
        check_config(cfg)


HALF_ENV = """
from datasets import Dataset
class Half:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Say {i}", "n": i} for i in range(24)])
    def score_episode(self, model, tokenizer, completion, n):
        return 0.5
"""


@pytest.mark.parametrize("eval_reward, mean, plan_says", [
    ("env", 0.5, "the env's score alone (training sums 1 x env + 0.5 x length_penalty; eval.reward=total"),
    ("total", 1.0, "the reward training sums: 1 x env + 0.5 x length_penalty"),
])
def test_eval_reward_scores_held_out_sets_by_the_env_alone_or_by_the_total(compose_cfg, tmp_path, monkeypatch,
                                                                           caplog, eval_reward, mean, plan_says):
    # the env scores 0.5 everywhere; length_penalty gives 1.0 to any completion under 200 tokens (8 here), so the
    # total is 1 x 0.5 + 0.5 x 1.0 = 1.0: the two scorings must differ
    monkeypatch.chdir(tmp_path)
    (tmp_path / "half_env.py").write_text(HALF_ENV)
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=half_env.Half"]), "reward=length_penalty",
                       "eval.enabled=true", "eval.num_prompts=4", "training.max_steps=1", f"eval.reward={eval_reward}"])
    with caplog.at_level("WARNING"):
        result = train(cfg, launch_dir=str(tmp_path))
    assert result.eval_before["mean_reward"] == pytest.approx(mean) == result.eval_after["mean_reward"]
    assert result.eval_before["success_rate"] == 0.0  # total: every part full would be 1.5
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_reward"] == eval_reward and summary["eval_before"]["reward"] == eval_reward
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    (choice,) = [c for c in plan["choices"] if c["key"] == "eval.reward"]
    assert choice["value"] == eval_reward and plan_says in choice["why"]
    assert f"over 4 held-out prompts (eval.reward={eval_reward}" in caplog.text
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    test_before = [e for e in episodes if e["split"] == "test_before"]
    assert {e["reward"] for e in test_before} == {mean}
    if eval_reward == "total":  # the ledger keeps each part
        assert {e["rewards"]["env"] for e in test_before} == {0.5}
        assert {e["rewards"]["length_penalty"] for e in test_before} == {1.0}
