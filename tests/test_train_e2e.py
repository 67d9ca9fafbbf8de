"""A tiny end-to-end GRPO run: outputs on disk, the MLflow run, user envs outside the package, failures."""

import json
import textwrap
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import run_cli, tiny_overrides
from grpo_pipeline.errors import EnvError
from grpo_pipeline.recipe import train


def mlflow_runs(db: Path, experiment="grpo_pipeline"):
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id]) if exp else [])


def test_tiny_training_end_to_end(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path), "eval.enabled=true", "eval.num_prompts=4", "loss.kl_coef=0.01"])
    result = train(cfg, launch_dir=str(tmp_path))
    run_dir = tmp_path / "run"

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("model_path", "num_samples", "num_epochs", "steps", "first_reward", "last_reward", "average_reward"):
        assert key in summary, key
    assert summary["steps"] == 2 and summary["num_samples"] == 20 and len(summary["reward_curve"]) == 2
    assert summary["eval_before"]["num_prompts"] == 4 and summary["eval_after"]["num_prompts"] == 4
    assert (Path(result.model_path) / "adapter_model.safetensors").exists()  # LoRA is the default
    assert "loss_type: dapo" in (run_dir / "resolved_config.yaml").read_text()
    assert (run_dir / "reward_curve.png").stat().st_size > 1000

    client, runs = mlflow_runs(tmp_path / "mlflow.db")
    assert len(runs) == 1 and runs[0].info.run_id == result.mlflow_run_id
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["loss.kl_coef"] == "0.01" and run.data.params["model.name"] == "tiny"
    for metric in ("reward", "kl", "loss", "completions/mean_length", "rewards/env/mean", "env/failures",
                   "eval_before/mean_reward", "eval_after/mean_reward"):
        assert metric in run.data.metrics, metric
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward")] == [1, 2]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "resolved_config.yaml", "reward_curve.png"} <= artifacts
    # the UI opens the experiment in its training-runs view, and the run says what was trained
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith("GRPO (dapo, kl_coef 0.01) of tiny on ArithmeticEnv: LoRA r=16, 2 steps") and "seed 42" in note


def test_full_finetune_without_lora_saves_weights(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path), "lora=off", "training.max_steps=1", "tracking.enabled=false"])
    result = train(cfg, launch_dir=str(tmp_path))
    assert (Path(result.model_path) / "model.safetensors").exists()
    assert result.mlflow_run_id is None and result.steps == 1


FLAKY_ENV = """
from datasets import Dataset
class Flaky:
    def __init__(self):
        self.calls = 0
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Say {i}", "n": i} for i in range(16)])
    def score_episode(self, model, tokenizer, completion, n):
        self.calls += 1
        if self.calls > 4:  # the second step's episodes fail
            raise ConnectionError("sandbox went away")
        return 0.5
"""


def test_env_error_stops_run_marks_failed_and_keeps_the_trained_adapter(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flaky_env.py").write_text(FLAKY_ENV)
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=flaky_env.Flaky"]), "training.max_steps=3",
                       "runtime.on_error=raise"])
    with pytest.raises(EnvError, match="Flaky.score_episode raised"):
        train(cfg, launch_dir=str(tmp_path))
    _, runs = mlflow_runs(tmp_path / "mlflow.db")
    assert [r.info.status for r in runs] == ["FAILED"]
    assert (tmp_path / "run" / "model-interrupted" / "adapter_model.safetensors").exists()


USER_ENV = """
from datasets import Dataset

class HotelEnv:
    '''A user's own multi-turn env: asks the live policy for a second turn.'''
    def __init__(self, max_turns=3, difficulty="normal"):
        self.max_turns, self.difficulty = max_turns, difficulty

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Book room {i}"}], "room": i}
                                  for i in range(12)])

    def score_episode(self, model, tokenizer, completion, room):
        assert not model.training
        for _ in range(self.max_turns - 1):
            ids = tokenizer(completion, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=4, do_sample=False)
            completion = tokenizer.decode(out[0], skip_special_tokens=True)
        return 1.0 if str(room) in completion else 0.1 * (self.difficulty == "hard")
"""

SHRINK = ["model=tiny", "training.max_steps=1", "training.batch_size=4", "generation.num_generations=2",
          "generation.max_new_tokens=6", "eval.enabled=false"]


def _user_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "my_envs").mkdir(parents=True)
    (project / "my_envs" / "__init__.py").write_text("")
    (project / "my_envs" / "hotel_env.py").write_text(USER_ENV)
    return project


def test_user_env_from_command_line(tmp_path):
    project = _user_project(tmp_path)
    proc = run_cli([*SHRINK, "env=custom", "env._target_=my_envs.hotel_env.HotelEnv", "+env.max_turns=2",
                    "+env.difficulty=hard"], cwd=project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = list((project / "outputs" / "runs").rglob("summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["steps"] == 1
    assert "env.difficulty: hard" not in proc.stdout  # sanity: config is not echoed
    resolved = (summaries[0].parent / "resolved_config.yaml").read_text()
    assert "difficulty: hard" in resolved and "max_turns: 2" in resolved
    _, runs = mlflow_runs(project / "outputs" / "mlflow.db")
    assert [r.info.status for r in runs] == ["FINISHED"]


def test_user_env_from_own_config_dir(tmp_path):
    project = _user_project(tmp_path)
    (project / "my_conf" / "env").mkdir(parents=True)
    (project / "my_conf" / "env" / "my_hotel.yaml").write_text(textwrap.dedent("""\
        # my hotel env
        _target_: my_envs.hotel_env.HotelEnv
        max_turns: 3
        difficulty: normal
    """))
    proc = run_cli(["--config-dir", "my_conf", "env=my_hotel", *SHRINK, "tracking.enabled=false"], cwd=project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = next((project / "outputs" / "runs").rglob("summary.json"))
    assert "_target_: my_envs.hotel_env.HotelEnv" in (summary.parent / "resolved_config.yaml").read_text()


def test_bad_env_kwarg_fails_fast_with_one_message_and_no_run(tmp_path):
    project = _user_project(tmp_path)
    proc = run_cli([*SHRINK, "env=custom", "env._target_=my_envs.hotel_env.HotelEnv", "+env.max_turnz=2"],
                   cwd=project)
    assert proc.returncode == 2
    assert "HotelEnv does not accept the config's kwargs ['max_turnz']" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (project / "outputs" / "mlflow.db").exists()
    assert not list((project / "outputs").rglob("model"))


def test_cli_prints_composed_config(tmp_path):
    proc = run_cli(["env=hotel", "loss=dapo", "--cfg", "job"], cwd=tmp_path)
    assert proc.returncode == 0
    assert "_target_: grpo_pipeline.envs.hotel.HotelEnv" in proc.stdout and "loss_type: dapo" in proc.stdout


def test_typo_on_cli_names_full_key(tmp_path):
    proc = run_cli(["model=tiny", "loss.kl_coeff=0.1"], cwd=tmp_path)
    assert proc.returncode != 0 and "loss.kl_coeff" in proc.stderr


def test_hotel_env_trains_on_tiny(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=hotel", "env.num_samples=8", "env.turn_max_new_tokens=4"]),
                       "training.max_steps=1"])
    result = train(cfg, launch_dir=str(tmp_path))
    assert result.steps == 1 and 0.0 <= result.last_reward <= 1.0


def test_credentials_in_urls_are_not_logged_as_params():
    from grpo_pipeline.tracking.mlflow_run import flatten

    params = flatten({"tracking": {"tracking_uri": "https://alice:s3cret@mlflow.example.com"},
                      "vllm": {"server_base_url": "http://tok@10.0.0.1:8000"}, "loss": {"kl_coef": 0.1}})
    assert params == {"tracking.tracking_uri": "https://***@mlflow.example.com",
                      "vllm.server_base_url": "http://***@10.0.0.1:8000", "loss.kl_coef": "0.1"}


def test_the_run_says_how_long_it_will_take_after_its_first_steps(compose_cfg, tmp_path, caplog):
    import logging

    from grpo_pipeline import recipe
    from grpo_pipeline.training.callbacks import estimate

    with caplog.at_level(logging.WARNING, logger="grpo_pipeline.training.callbacks"):
        recipe.train(compose_cfg([*tiny_overrides(tmp_path), "training.max_steps=5"]), launch_dir=str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Run length:")]
    assert len(lines) == 1 and "3 steps took a median" in lines[0] and "the remaining 2 step(s) take" in lines[0]
    assert "remaining 40 step(s) take ~6 min" in estimate([8.0, 9.0, 30.0], 10, 50)  # the median: 9 s, not the mean
