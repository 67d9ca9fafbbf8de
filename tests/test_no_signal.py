"""training.no_signal: a run whose groups carry no reward spread (or whose policy collapsed) stops with a checkpoint
and a diagnosis, instead of training on for hours."""

import pytest
from datasets import Dataset

import grpo_pipeline.recipe as recipe
from conftest import tiny_overrides
from grpo_pipeline.training.callbacks import no_signal_diagnosis
from grpo_pipeline.training.checkpoints import TrainingStopped


def test_the_diagnosis_says_which_way_the_signal_is_missing():
    right = no_signal_diagnosis([(1.0, 1.0, 0.2)] * 5, flat_share=0.95, patience=5, min_entropy=0.0, step=9)
    assert right.startswith("no learning signal at step 9") and "every completion is right" in right
    wrong = no_signal_diagnosis([(1.0, 0.0, 0.2)] * 5, 0.95, 5, 0.0, 9)
    assert "every completion is wrong" in wrong and "generation.num_generations" in wrong
    same = no_signal_diagnosis([(0.96, 0.5, 0.01)] * 5, 0.95, 5, 0.0, 9)
    assert "score the same" in same
    assert no_signal_diagnosis([(0.9, 0.5, 0.2)] * 5, 0.95, 5, 0.0, 9) is None  # 10% of groups still teach
    assert no_signal_diagnosis([(1.0, 0.0, 0.2)] * 4, 0.95, 5, 0.0, 9) is None  # not yet `patience` steps
    collapsed = no_signal_diagnosis([(0.5, 0.5, 0.001)] * 5, 0.95, 5, min_entropy=0.01, step=9)
    assert "entropy" in collapsed and "loss.kl_coef" in collapsed
    assert no_signal_diagnosis([(0.5, 0.5, 0.001)] * 5, 0.95, 5, min_entropy=0.0, step=9) is None  # 0: off


class SameScoreEnv:
    """Every completion scores 0.5: no group ever has reward spread."""

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Say {i}", "i": i} for i in range(24)])

    def score_episode(self, model, tokenizer, completion, i):
        return 0.5


def test_a_run_without_reward_spread_stops_with_a_checkpoint_and_says_why(compose_cfg, tmp_path):
    overrides = [*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "training.max_steps=30",
                 "training.no_signal.patience=3", "training.no_signal.min_groups=1"]
    with pytest.raises(TrainingStopped, match="no learning signal at step 3: 100% of the groups") as stopped:
        recipe.train(compose_cfg(overrides), launch_dir=str(tmp_path), env=SameScoreEnv())
    assert "score the same (mean reward 0.500" in str(stopped.value) and "Continue with" in str(stopped.value)
    assert (tmp_path / "run" / "checkpoints" / "checkpoint-3").is_dir()  # nothing trained is lost
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])[0]
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith("Stopped because no learning signal")


def test_the_check_can_be_turned_off(compose_cfg, tmp_path):
    overrides = [*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "training.max_steps=4",
                 "training.no_signal.patience=2", "training.no_signal.min_groups=1", "training.no_signal.enabled=false"]
    assert recipe.train(compose_cfg(overrides), launch_dir=str(tmp_path), env=SameScoreEnv()).steps == 4
