"""The Python API: the same recipe as the CLI (same validation, MLflow logging and outputs).

    from grpo_pipeline import train
    result = train(["model=tiny", "env=arithmetic", "training.max_steps=4"])
    result = train(["model=tiny"], env=MyEnv)          # an env class (kwargs from env.*) or an instance
    print(result.model_path, result.average_reward, result.mlflow_run_id)

Each call composes `conf/` afresh (plus `config_dir`, like --config-dir) and clears Hydra's global
state afterwards, and MLflow is used through an explicit client, so calls in one process (a notebook)
do not leak state into each other.
"""

import os
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.config.schema import register_configs
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.recipe import RunResult
from grpo_pipeline.recipe import train as run_recipe


def compose_config(overrides: list[str] | None = None, config_dir: str | Path | None = None) -> DictConfig:
    """Compose conf/train.yaml with Hydra overrides; a bad override is a ConfigError naming the key."""
    register_configs()
    overrides = list(overrides or [])
    if config_dir is not None:
        overrides.append(f"hydra.searchpath=[file://{Path(config_dir).resolve()}]")
    resume = next((o.partition("=")[2] for o in overrides if o.startswith("resume=")), None)
    if resume not in (None, "auto", "null"):  # the run's own overrides, then these (run_dir.resume_overrides)
        from grpo_pipeline.training.run_dir import read_record, resume_overrides

        record = read_record(resume)
        if record is not None:
            overrides = [*resume_overrides(record, overrides), f"resume={resume}"]
    if not any(o.startswith("output_dir=") for o in overrides):
        stamp = time.strftime("%Y-%m-%d/%H-%M-%S") + f"-{time.time_ns() % 1_000_000:06d}"
        overrides.append(f"output_dir={Path('outputs/runs') / stamp}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=overrides)
    except Exception as e:  # Hydra's and OmegaConf's compose errors: keep their message, drop the traceback
        cause = f" ({e.__cause__})" if e.__cause__ and str(e.__cause__) not in str(e) else ""
        raise ConfigError(f"{e}{cause}".strip()) from e
    finally:
        GlobalHydra.instance().clear()


def train(overrides: list[str] | None = None, *, config: DictConfig | None = None, env: Any = None,
          config_dir: str | Path | None = None, tags: dict[str, str] | None = None) -> RunResult:
    """Run one training; returns the RunResult (model_path, steps, rewards, eval, mlflow_run_id, run_dir)."""
    cfg = config if config is not None else compose_config(overrides, config_dir)
    return run_recipe(cfg, launch_dir=os.getcwd(), overrides=overrides, env=env, tags=tags)
