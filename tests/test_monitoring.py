"""Monitoring users already have: tracking.report_to (TensorBoard, wandb) beside MLflow."""

import json
import os
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import run_cli, tiny_overrides
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


def _fresh_trainer(compose_cfg, tmp_path, *overrides):
    """The run's PipelineTrainer as the recipe builds it, before any step (tracking off: nothing to open)."""
    from grpo_pipeline.recipe import _build_trainer, prepare

    cfg = compose_cfg([*tiny_overrides(tmp_path), "tracking.enabled=false", "ledger.enabled=false", *overrides])
    run = prepare(cfg, launch_dir=str(tmp_path))
    return run, _build_trainer(run, None, [])


def test_kl_to_base_is_zero_before_training_with_lora_and_grows_as_the_adapter_moves(compose_cfg, tmp_path):
    from grpo_pipeline.evaluation.heldout import evaluate
    from grpo_pipeline.evaluation.kl_to_base import KlToBase

    run, trainer = _fresh_trainer(compose_cfg, tmp_path)  # lora=default
    policy = trainer.accelerator.unwrap_model(trainer.model)
    kl = KlToBase.for_trainer(trainer, batch_size=4)
    assert kl is not None and getattr(trainer, "ref_model", None) is None  # the adapter switched off, no copy

    def kl_now():
        run.runner.bind(policy)
        return evaluate(policy, run.tokenizer, run.runner, run.split.train.select(range(6)), 8, 4, run.rollout,
                        kl=kl)["kl_to_base"]

    assert kl_now() == pytest.approx(0.0, abs=1e-6)  # LoRA's B starts at zero: the policy is the base model
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.normal_(0.0, 0.5)
    assert kl_now() > 0.01 and policy.training  # (the random tiny model stays near uniform: ~0.08); train mode back


def test_validation_logs_kl_to_base_and_warns_when_the_policy_drifts(caplog):
    from transformers import TrainerState

    from grpo_pipeline.evaluation.best_model import Validation

    class Tracker:
        logged = {}

        def log_metrics(self, values, step):
            self.logged |= values

    tracker = Tracker()
    scores = iter([0.1, 0.73])
    validation = Validation(lambda: {"mean_reward": 0.5, "success_rate": 0.0, "kl_to_base": next(scores)},
                            every_steps=1, patience=0, best_dir=None, policy=None, tracker=tracker)
    state = TrainerState(global_step=5, max_steps=10)
    with caplog.at_level("WARNING"):
        validation.validate(state)
        assert tracker.logged["eval_val/kl_to_base"] == 0.1 and "drifting" not in caplog.text
        state.global_step = 10
        validation.validate(state)
    assert tracker.logged["eval_val/kl_to_base"] == 0.73
    assert ("validation step 10: eval_val/kl_to_base 0.730 > 0.5: the policy is drifting far from the base model: "
            "lower the learning rate (training.learning_rate) or raise loss.kl_coef") in caplog.text


def test_kl_to_base_is_logged_at_validation_steps_whatever_kl_coef(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path), "loss.kl_coef=0", "eval.enabled=true", "eval.num_prompts=4",
                       "eval.val_prompts=4", "eval.every_steps=1"])
    result = train(cfg, launch_dir=str(tmp_path))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(result.mlflow_run_id, "eval_val/kl_to_base")
    assert [m.step for m in history] == [1, 2]
    assert all(0.0 <= m.value < 0.5 for m in history)
    assert "kl" not in client.get_run(result.mlflow_run_id).data.metrics  # TRL's own kl needs beta != 0


def test_kl_to_base_without_a_reference_model_is_skipped_and_said_once(compose_cfg, tmp_path, caplog):
    cfg = compose_cfg([*tiny_overrides(tmp_path), "lora=off", "loss.kl_coef=0", "eval.enabled=true",
                       "eval.num_prompts=4", "eval.val_prompts=4", "eval.every_steps=1", "training.save_model=false"])
    with caplog.at_level("WARNING"):
        result = train(cfg, launch_dir=str(tmp_path))
    assert caplog.text.count("eval_val/kl_to_base is not computed: full fine-tuning with loss.kl_coef=0") == 1
    metrics = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id).data.metrics
    assert "eval_val/mean_reward" in metrics and "eval_val/kl_to_base" not in metrics


def test_the_end_of_a_run_prints_the_mlflow_ui_pages_of_its_experiment_runs_and_of_the_run(tmp_path):
    proc = run_cli([*tiny_overrides(tmp_path), "training.max_steps=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("grpo_pipeline")
    (run,) = client.search_runs([experiment.experiment_id])
    runs_view = f"http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs"
    assert f"MLflow UI (serve it with: mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}):" in proc.stdout
    assert f"  the experiment's runs: {runs_view}?viewStateShareKey=grpo_pipeline\n" in proc.stdout
    assert f"  this run:              {runs_view}/{run.info.run_id}\n" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mlflow_ui"]["run"] == f"{runs_view}/{run.info.run_id}"
    # the view the link opens: the reward and the held-out gain as columns (docs/runs_in_mlflow.png)
    view = json.loads(experiment.tags["mlflow.sharedViewState.grpo_pipeline"])
    assert {"metrics.`reward`", "metrics.`eval_after/gain`"} <= set(view["selectedColumns"])


def test_ui_links_of_a_tracking_server_are_its_own_pages_without_credentials():
    from grpo_pipeline.tracking.mlflow_run import ui_links

    links = ui_links("https://alice:s3cret@mlflow.example.org/base/", "7", "abc123")
    assert links == {"experiment_runs": "https://mlflow.example.org/base/#/experiments/7/runs"
                                        "?viewStateShareKey=grpo_pipeline",
                     "run": "https://mlflow.example.org/base/#/experiments/7/runs/abc123", "serve": None}
