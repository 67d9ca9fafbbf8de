"""Divergence is visible and stops the run; an env's mistakes fail one episode, not the run, or are found at startup."""

import math
import re

import numpy as np
import pytest
import torch
from datasets import Dataset
from mlflow.tracking import MlflowClient

import grpo_pipeline.recipe as recipe
from conftest import tiny_overrides
from grpo_pipeline.envs.runner import score_problem
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.rollout import decode as sampler
from grpo_pipeline.training.callbacks import Diverged


class _VariedEnv:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Count to {i}", "i": i} for i in range(24)])

    def score_episode(self, model, tokenizer, completion, i):
        return (len(completion) % 7) / 6  # reward spread: real gradients


@pytest.mark.parametrize("lr", [1e20])  # Adam's step is ~lr: at 1e3 the tiny model saturates, finite; 1e20 overflows
def test_a_diverging_run_stops_with_the_last_finite_weights_kept(compose_cfg, tmp_path, lr):
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]),
                       f"training.learning_rate={lr}", "training.max_steps=30", "training.save_steps=1"])
    with pytest.raises(Diverged, match=rf"diverged (at|after) step.*Lower training.learning_rate \(now {re.escape(f'{lr:g}')}\)") as e:
        recipe.train(cfg, launch_dir=str(tmp_path), env=_VariedEnv())
    step = int(e.value.args[0].split("step ")[1].split(":")[0])  # the last step whose update was kept
    step -= " at step" in e.value.args[0]
    assert step >= 1
    run_dir = tmp_path / "run"
    from safetensors.torch import load_file

    weights = load_file(next((run_dir / "model-interrupted").glob("*.safetensors")))
    assert weights and all(torch.isfinite(w).all() for w in weights.values())  # the optimizer step was not taken
    assert (run_dir / "checkpoints" / f"checkpoint-{step}").is_dir()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])[0]
    assert run.info.status == "FAILED" and "diverged" in run.data.tags["error"]


def test_non_finite_metrics_are_counted_not_dropped(tmp_path):
    from grpo_pipeline.config.schema import TrackingConfig
    from grpo_pipeline.tracking.mlflow_run import Tracker

    tracker = Tracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", flush_every_s=0.05), tmp_path)
    tracker.start("t", {}, {})
    tracker.log_metrics({"loss": math.nan, "reward": 0.5}, step=1)
    tracker.log_metrics({"loss": math.inf, "reward": 0.6}, step=2)
    tracker.end("FINISHED")
    client = MlflowClient(tracker.uri)
    history = {m.step: m.value for m in client.get_metric_history(tracker.run_id, "nonfinite/loss")}
    assert history == {1: 1.0, 2: 2.0}


def test_the_sampler_fails_on_a_nan_distribution_as_generate_does():
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan`"):
        sampler._sample(torch.full((2, 5), math.nan))


def test_numpy_and_torch_scalars_are_scores():
    for value in (np.float32(0.5), np.float64(1.0), np.int64(0), torch.tensor(0.25), np.array(0.5)):
        assert score_problem(value) is None, value
    for value in (torch.tensor([0.5]), np.float32(1.5), torch.tensor(math.nan), "0.5", True, None):
        assert score_problem(value) is not None, value


class _Env:
    def __init__(self, columns=("answer",)):
        self.columns = columns

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Say {i}", **{c: str(i) for c in self.columns}} for i in range(12)])

    def score_episode(self, model, tokenizer, completion, **row):
        return np.float32(0.5)  # a numpy score: accepted


@pytest.mark.parametrize("column", ["completion", "model", "trainer_state", "transcript"])
def test_a_column_named_like_an_argument_is_refused_before_weights_load(compose_cfg, tmp_path, column):
    cfg = compose_cfg(tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]))
    with pytest.raises(ConfigError, match=rf"column\(s\) \['{column}'\].*rename_columns\(\{{'{column}' -> "):
        recipe.train(cfg, launch_dir=str(tmp_path), env=_Env(columns=("answer", column)))
    assert not (tmp_path / "run" / "run.json").exists()


class _TurnEnv:
    """respond returns a wrong type on row 1, episode_metrics raises on row 2."""

    max_turns = 2
    turn_max_new_tokens = 4

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Count to {i}"}], "i": i}
                                  for i in range(4)])  # every row in every step

    def respond(self, messages, i):
        return 42 if i == 1 else "go on"

    def episode_metrics(self, completion, i):
        if i == 2:
            raise KeyError("no such metric")
        return {"turns": np.int64(len(completion))}

    def score_episode(self, model, tokenizer, completion, i):
        return torch.tensor(0.5)


def test_env_mistakes_fail_their_episodes_under_the_budget(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]),
                       "runtime.max_failure_rate=0.9", "training.batch_size=8"])
    result = recipe.train(cfg, launch_dir=str(tmp_path), env=_TurnEnv())
    assert result.steps == 2
    from grpo_pipeline.tracking.ledger import read

    train = [e for e in read(tmp_path / "run" / "episodes.jsonl") if e["split"] == "train"]
    failures = {e["row"]["i"]: e["failure"] for e in train if e["failure"]}
    assert set(failures) == {1, 2}  # only the rows with the mistakes, and the run went on
    assert "_TurnEnv.respond raised" in failures[1] and "_TurnEnv.episode_metrics raised" in failures[2]
    metrics = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id).data.metrics
    assert metrics["env/failures"] == len([e for e in train if e["failure"]])


def test_a_template_that_cannot_append_turns_is_found_at_startup(compose_cfg, tmp_path):
    template = tmp_path / "rewrites.jinja"  # renders the last user turn differently once a message follows it
    template.write_text("{% for m in messages %}{% if loop.last %}<last>{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]),
                       f"model.chat_template={template}"])
    with pytest.raises(ConfigError, match="_TurnEnv is multi-turn.*cannot append its turns"):
        recipe.train(cfg, launch_dir=str(tmp_path), env=_TurnEnv())
    assert not (tmp_path / "run" / "episodes.jsonl").exists()
