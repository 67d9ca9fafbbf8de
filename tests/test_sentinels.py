"""Sentinels: a sampler that does not hold the policy's weights stops the run; the sampler/trainer log-prob gap is
watched; under top-k the log-probs the loss takes as the sampler's are the untruncated ones, as TRL's."""

import logging

import pytest
import torch

import grpo_pipeline.recipe as recipe
from conftest import tiny_overrides
from grpo_pipeline.config.schema import ModelConfig
from grpo_pipeline.models import build_tiny_model, build_tiny_tokenizer
from grpo_pipeline.rollout.policy_copy import MergedCopy
from grpo_pipeline.rollout.sentinel import LogpGapWatch, SamplerStale
from grpo_pipeline.rollout.turns import generate


class LengthEnv:
    """Scores a completion by its length: the tiny model's groups have reward spread, so its adapter trains."""

    def build_dataset(self, tokenizer):
        from datasets import Dataset

        return Dataset.from_list([{"prompt": f"Count to {i}", "i": i} for i in range(24)])

    def score_episode(self, model, tokenizer, completion, i):
        return (len(completion) % 5) / 4


def test_a_copy_that_stops_following_the_policy_stops_the_run(compose_cfg, tmp_path, monkeypatch):
    original = MergedCopy.of

    def never_refreshed(self, policy):  # the bug the sentinel exists for: built once, never updated
        return original(self, policy) if self._copy is None else self._copy

    monkeypatch.setattr(MergedCopy, "of", never_refreshed)
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "training.max_steps=6",
                       "training.learning_rate=0.05", "sentinel.every_steps=1"])
    with pytest.raises(SamplerStale, match="does not hold the policy's current weights") as stopped:
        recipe.train(cfg, launch_dir=str(tmp_path), env=LengthEnv())
    assert "merged float32 copy" in str(stopped.value)
    assert (tmp_path / "run" / "model-interrupted").is_dir()  # what was trained is kept


def test_a_healthy_run_logs_its_sentinels(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "training.max_steps=4",
                       "training.learning_rate=0.05", "sentinel.every_steps=3"])
    result = recipe.train(cfg, launch_dir=str(tmp_path), env=LengthEnv())
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    match = client.get_metric_history(result.mlflow_run_id, "sentinel/weights_match")
    assert sorted(m.step for m in match) == [1, 4] and all(m.value == 1.0 for m in match)  # every 3 steps
    gap = client.get_metric_history(result.mlflow_run_id, "sentinel/weights_gap")
    assert all(m.value < 1e-3 for m in gap)  # a float32 copy: the policy's log-probs to float rounding
    logp = client.get_metric_history(result.mlflow_run_id, "sentinel/logp_gap_max")
    assert len(logp) == 4 and all(m.value < 1e-3 for m in logp)  # a float32 copy samples what the trainer computes


def test_the_log_prob_gap_warns_then_stops(caplog):
    watch = LogpGapWatch(warn=2.0, stop=5.0, patience=2)
    with caplog.at_level(logging.WARNING):
        watch.observe(0.9, 0.01, step=1)
        assert not caplog.records
        watch.observe(3.0, 0.05, step=2)
    assert "differ from the trainer's by up to 3.00" in caplog.text
    watch.observe(6.0, 0.5, step=3)
    watch.observe(1.0, 0.01, step=4)  # back under: the count starts again
    watch.observe(6.0, 0.5, step=5)
    with pytest.raises(SamplerStale, match="for 2 steps in a row"):
        watch.observe(7.0, 0.6, step=6)


def test_under_top_k_the_sampled_log_probs_are_the_untruncated_ones():
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer)
    sampling = {"do_sample": True, "temperature": 0.8, "top_k": 5, "top_p": 1.0}
    prompt = tokenizer("Count to three", add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    ids, logps = generate(model, [prompt], 6, sampling, [], tokenizer.pad_token_id or 0)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids[0]])).logits[0, len(prompt) - 1 : -1].float() / 0.8
    untruncated = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[0])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(logps[0]), untruncated, atol=1e-4)
    # the tokens came from the top-5 distribution, whose renormalised log-probs are higher: not what TRL's ratio uses
    top5 = logits.topk(5, -1)
    assert all(t in row for t, row in zip(ids[0], top5.indices.tolist(), strict=True))
    truncated = untruncated - torch.logsumexp(top5.values, -1) + torch.logsumexp(logits, -1)
    assert (truncated > untruncated + 1e-3).all()
