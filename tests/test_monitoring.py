"""Monitoring users already have: tracking.report_to (TensorBoard, wandb) beside MLflow."""

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
