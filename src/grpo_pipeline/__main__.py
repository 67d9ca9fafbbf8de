"""`python -m grpo_pipeline [group=option ...] [key=value ...]`: one Hydra job = one GRPO run.
`--plan` prints the run plan (what the run would decide for this machine, model, env and data) and runs nothing.
`python -m grpo_pipeline check|compare|episodes|rescore|launch|translate ...` runs a tool (grpo_pipeline/tools/).

A PipelineError (bad config, broken env) ends the job with its one-paragraph message and exit code 2;
set GRPO_PIPELINE_TRACEBACK=1 to see the Python traceback too.
"""

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]  # `python -m` put the launch dir first; the env loader adds it only while importing the env

import logging
import warnings

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.config.schema import register_configs
from grpo_pipeline.errors import PipelineError
from grpo_pipeline.tracking.redact import (
    mask_secrets,
    redact_hydra_files,
    redact_log_records,
    register_config,
    register_overrides,
)

register_configs()
PLAN_ONLY = False  # --plan
# the tools around training, as subcommands: `python -m grpo_pipeline <name> ...` (or grpo-pipeline <name> ...)
TOOLS = {"check": "doctor", "compare": "compare", "episodes": "episodes", "rescore": "rescore", "launch": "launch",
         "translate": "translate"}


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    from grpo_pipeline.config.validate import check_config
    from grpo_pipeline.tracking.sweep import sweep_job

    hydra_cfg = HydraConfig.get()
    register_config(cfg)  # secret values and what ${oc.env:...} resolves to: masked in everything written
    redact_hydra_files(hydra_cfg)
    overrides = list(hydra_cfg.overrides.task)
    try:
        tags, name = sweep_job(hydra_cfg.sweep.dir, overrides) if hydra_cfg.mode == RunMode.MULTIRUN else (None, None)
        if name and not cfg.tracking.run_name:
            cfg.tracking.run_name = name
        if cfg.resume not in (None, "auto") and hydra_cfg.mode != RunMode.MULTIRUN:
            cfg, overrides = _resumed(cfg, overrides)
        check_config(cfg)  # a config error is reported in seconds, before torch and transformers load
        if PLAN_ONLY:
            from grpo_pipeline.recipe import plan_only

            print(plan_only(cfg, launch_dir=hydra.utils.get_original_cwd()).table())
            return None
        from grpo_pipeline.recipe import train

        result = train(cfg, launch_dir=hydra.utils.get_original_cwd(), overrides=overrides, tags=tags)
    except (Exception, KeyboardInterrupt) as e:
        if hydra_cfg.mode == RunMode.MULTIRUN:  # a FAILED child run and the sweep goes on; a signal stops it
            from grpo_pipeline.tracking.sweep import job_failed

            return job_failed(cfg, e)
        if not isinstance(e, PipelineError) or os.environ.get("GRPO_PIPELINE_TRACEBACK"):
            raise
        print(f"\nERROR: {mask_secrets(str(e))}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))
    from grpo_pipeline.tracking.outputs import end_lines

    print(end_lines(result))
    # The value a sweeper (e.g. Optuna) maximises.
    if result.eval_after:
        return result.eval_after["mean_reward"]
    return result.last_reward


def _resumed(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """resume=<run dir>: the run's own overrides, then this command's (run_dir.resume_overrides)."""
    from hydra import compose

    from grpo_pipeline.training.run_dir import read_record, resume_overrides

    record = read_record(cfg.resume)
    if record is None:  # not a run dir of this version: the recipe says what is wrong with it
        return cfg, overrides
    merged = [*resume_overrides(record, overrides), f"resume={cfg.resume}"]
    try:
        resumed = compose(config_name="train", overrides=merged)
    except Exception as e:
        raise PipelineError(f"resume={cfg.resume}: the run's overrides and this command's do not compose ({e}).") from e
    register_config(resumed)
    return resumed, overrides


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:  # python -m grpo_pipeline check|rescore|... (grpo_pipeline/tools/)
        import importlib

        name = sys.argv.pop(1)
        tool = importlib.import_module(f"grpo_pipeline.tools.{TOOLS[name]}")
        sys.argv[0] = f"grpo-pipeline {name}"
        tool.main(sys.argv[1:]) if name != "check" else tool.main()
        return
    global PLAN_ONLY
    if "--plan" in sys.argv[1:]:  # print the run plan (config/plan.py), run nothing
        sys.argv.remove("--plan")
        PLAN_ONLY = True
    register_overrides(sys.argv[1:])  # secrets given on the command line, before Hydra logs or writes them
    redact_log_records()  # before Hydra logs the overrides (e.g. a multirun's job list)
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' v6 renames flood the console
    _hydra_main()


if __name__ == "__main__":
    main()
