"""The Python API (two calls in one process, result fields, env passed as a class or instance)."""

from pathlib import Path

import pytest
from datasets import Dataset
from mlflow.tracking import MlflowClient

import grpo_pipeline
from grpo_pipeline.envs.arithmetic import ArithmeticEnv


def _overrides(tmp_path, name):
    return ["model=tiny", "training.max_steps=1", "training.batch_size=4",
            "generation.num_generations=2", "generation.max_new_tokens=6", "eval.num_prompts=4",
            f"output_dir={tmp_path / name}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]


class NotebookEnv:
    def __init__(self, target: str = "7"):
        self.target = target

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Say {self.target}", "want": self.target}] * 8)

    def score_episode(self, model, tokenizer, completion, want):
        return float(want in completion)


def test_two_calls_in_one_process_give_two_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = grpo_pipeline.train(_overrides(tmp_path, "a") + ["env.num_samples=16"])
    second = grpo_pipeline.train(_overrides(tmp_path, "b") + ["env.num_samples=16", "loss=grpo"])
    for r in (first, second):
        assert r.steps == 1 and r.num_samples == 12 and Path(r.model_path).is_dir()
        assert r.eval_before["num_prompts"] == 4 and r.eval_after is not None
        assert r.first_reward is not None and r.average_reward is not None and r.num_epochs > 0
    assert first.mlflow_run_id != second.mlflow_run_id and first.run_dir != second.run_dir
    # the seed documents' API reads the result as a mapping
    assert first["model_path"] == first.model_path and first["num_epochs"] == first.num_epochs
    assert dict(first)["average_reward"] == first.average_reward and "eval_after" in first
    with pytest.raises(KeyError, match="'accuracy': a run result has run_dir, model_path"):
        first["accuracy"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])
    assert sorted(r.data.params["loss.loss_type"] for r in runs) == ["dapo", "grpo"]
    assert all(r.info.status == "FINISHED" for r in runs)


def test_env_passed_as_class_with_kwargs_from_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = grpo_pipeline.train(_overrides(tmp_path, "c") + ["env=custom", "+env.target=9", "eval.enabled=false"],
                                 env=NotebookEnv)
    assert result.steps == 1 and result.num_samples == 8
    assert "target: 9" in (Path(result.run_dir) / "resolved_config.yaml").read_text()


def test_env_passed_as_instance(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = grpo_pipeline.train(_overrides(tmp_path, "d") + ["eval.enabled=false"],
                                 env=ArithmeticEnv(num_samples=8, seed=5))
    assert result.num_samples == 8


def test_default_output_dir_is_under_outputs_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = grpo_pipeline.compose_config(["model=tiny"])
    assert cfg.output_dir.startswith("outputs/runs/")


def test_console_script_is_the_cli(tmp_path):
    import subprocess
    import sys

    script = Path(sys.prefix) / "bin" / "grpo-pipeline"
    proc = subprocess.run([str(script), "env=hotel", "--cfg", "job"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and "_target_: grpo_pipeline.envs.hotel.HotelEnv" in proc.stdout
