"""grpo_pipeline: Hydra-configured GRPO training against environments written in plain Python."""

__version__ = "0.1.0"
