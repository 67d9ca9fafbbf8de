"""Tests compose the real conf/ with overrides that shrink the run to the tiny model, each in its own tmp_path."""

import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.config.schema import register_configs

REPO = Path(__file__).resolve().parents[1]
register_configs()


def tiny_overrides(tmp_path: Path, env: list[str] | None = None) -> list[str]:
    """A 2-step run of the tiny model in tmp_path; `env` replaces the default small arithmetic env."""
    return [
        "model=tiny",
        *(env if env is not None else ["env=arithmetic", "env.num_samples=24"]),
        "training.max_steps=2",
        "training.batch_size=4",
        "generation.num_generations=2",
        "generation.oversample=1",  # the default run's dynamic sampling has its own tests
        "generation.resample_flat=0",  # nor its adaptive sampling
        "generation.max_new_tokens=8",
        # the same on every CPU (null picks bf16 where the CPU has it natively); tests/test_generation_dtype.py
        # runs the bf16 copy
        "runtime.generation_dtype=float32",
        "eval.enabled=false",
        f"output_dir={tmp_path / 'run'}",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]


@pytest.fixture(autouse=True, scope="session")
def _migrated_mlflow_schema(tmp_path_factory):
    """In this process, a new MLflow sqlite store gets its tables copied from one migrated once per session (the
    schema MLflow's ~40 migrations build, ~2.4 s a store on 2 cores) instead of running the migrations again.
    Subprocess runs (the CLI tests) still create their stores as a user's run does."""
    import sqlite3

    import sqlalchemy
    from mlflow.store.db import utils

    original = utils._initialize_tables
    template = tmp_path_factory.mktemp("mlflow_schema") / "schema.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{template}")
    original(engine)
    engine.dispose()

    def copy_schema(engine):
        if engine.url.get_backend_name() != "sqlite" or not engine.url.database:
            return original(engine)
        engine.dispose()  # no pooled connection holds the empty file while it is filled
        with sqlite3.connect(template) as src, sqlite3.connect(engine.url.database) as dst:
            src.backup(dst)

    utils._initialize_tables = copy_schema
    yield
    utils._initialize_tables = original


@pytest.fixture
def compose_cfg():
    """compose_cfg([...overrides]) -> the composed DictConfig of conf/train.yaml."""

    def _compose(overrides: list[str], config_dir: Path = CONFIG_DIR):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose(config_name="train", overrides=overrides)

    yield _compose
    GlobalHydra.instance().clear()


def run_cli(args: list[str], cwd: Path, timeout: int = 300, env_extra: dict | None = None):
    """`python -m grpo_pipeline ARGS` in cwd; returns the CompletedProcess."""
    import subprocess

    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "grpo_pipeline", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


def scripted(tokenizer, plan, real_logps: bool = False):
    """A stand-in for the runtime's batched decode (rollout/turns.py `generate`): sequence i of the k-th call writes
    plan(i, k) (its tokens, or the ids it gives, then eos), with the generating model's log-probs of those tokens (`real_logps`) under
    the call's temperature, or 0.0. Live episodes keep their order from one call to the next."""
    import torch

    calls = {"n": 0}

    def generate(model, sequences, max_new_tokens, sampling, eos_ids, pad_id, prefix=None, with_logprobs=True,
                 caches=None, snapshots=None):
        turn, calls["n"] = calls["n"], calls["n"] + 1
        ids, logps = [], []
        for i, context in enumerate(sequences):
            text = plan(i, turn)  # or the ids themselves
            new = (text if isinstance(text, list) else tokenizer(text, add_special_tokens=False)["input_ids"])
            new = new[: max_new_tokens - 1] + eos_ids[:1]
            ids.append(new)
            if not (real_logps and sampling.get("do_sample")):
                logps.append([0.0] * len(new))
                continue
            with torch.no_grad():
                logits = model(torch.tensor([context + new])).logits[0, len(context) - 1 : -1].float()
            logps.append(torch.log_softmax(logits / sampling["temperature"], -1)
                         .gather(-1, torch.tensor(new)[:, None]).squeeze(-1).tolist())
        return ids, logps

    return generate
