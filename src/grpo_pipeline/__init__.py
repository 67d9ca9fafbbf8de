"""grpo_pipeline: Hydra-configured GRPO training against environments written in plain Python."""

__version__ = "0.1.0"

__all__ = ["train", "compose_config", "RunResult"]


def __getattr__(name):  # lazy: `python -m grpo_pipeline --cfg job` must not import torch
    if name in ("train", "compose_config"):
        from grpo_pipeline import api

        return getattr(api, name)
    if name == "RunResult":
        from grpo_pipeline.recipe import RunResult

        return RunResult
    raise AttributeError(name)
