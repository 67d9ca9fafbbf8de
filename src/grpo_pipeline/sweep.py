"""Hydra multirun as first-class sweeps: a parent MLflow run per sweep, one child run per job, and a
comparison (table + reward-curve PNG) at the end, logged to the parent.

Registered in conf/train.yaml under hydra.callbacks, so `python -m grpo_pipeline -m loss.kl_coef=0,0.1`
and `+sweep=kl_x_generations` get it. Jobs find the parent through `<sweep dir>/sweep_parent_run_id`
(so it also works for launchers that run jobs in other processes).
"""

import json
import logging
import os
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)
PARENT_FILE = "sweep_parent_run_id"
KEYS_FILE = "sweep_keys.json"
_SWEEP_SYNTAX = ("range(", "choice(", "interval(", "glob(", "tag(")


def _client_and_experiment(config: DictConfig):
    from grpo_pipeline.tracking import Tracker

    tracker = Tracker(config.tracking, os.getcwd())
    return tracker.client, tracker.experiment_id


def swept_keys(task_overrides: list[str], sweeper_params: dict | None) -> list[str]:
    """The keys a sweep varies: comma lists / sweep functions on the command line, plus preset params."""
    keys = []
    for override in task_overrides:
        key, _, value = override.partition("=")
        if "," in value or value.startswith(_SWEEP_SYNTAX):
            keys.append(key.lstrip("+~"))
    return keys + [k for k in (sweeper_params or {}) if k not in keys]


def sweep_job(sweep_dir: str, overrides: list[str]) -> tuple[dict[str, str], str | None]:
    """(tags, run name) for a job of the sweep in sweep_dir: its parent run, the sweep id, and a name made
    of the swept overrides only (e.g. 'loss.kl_coef=0.05,generation.num_generations=8')."""
    tags = {"sweep_id": str(sweep_dir)}
    parent = Path(sweep_dir) / PARENT_FILE
    if parent.exists():
        tags["mlflow.parentRunId"] = parent.read_text().strip()
    keys_file = Path(sweep_dir) / KEYS_FILE
    name = None
    if keys_file.exists():
        keys = set(json.loads(keys_file.read_text()))
        name = ",".join(o for o in overrides if o.partition("=")[0].lstrip("+~") in keys) or None
    return tags, name


class SweepCallback(Callback):
    def __init__(self, metric: str = "reward"):
        self.metric = metric
        self.parent_id: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if not config.tracking.enabled:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        client, experiment_id = _client_and_experiment(config)
        overrides = " ".join(config.hydra.overrides.task)
        run = client.create_run(experiment_id, run_name=f"sweep {sweep_dir.name}: {overrides}"[:200],
                                tags={"sweep_id": str(sweep_dir), "sweep_role": "parent", "overrides": overrides})
        self.parent_id = run.info.run_id
        (sweep_dir / PARENT_FILE).write_text(self.parent_id)
        params = config.hydra.sweeper.get("params")
        keys = swept_keys(list(config.hydra.overrides.task), dict(params) if params else None)
        (sweep_dir / KEYS_FILE).write_text(json.dumps(keys))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if not self.parent_id:
            return
        from grpo_pipeline.compare import compare

        client, _ = _client_and_experiment(config)
        try:
            text, png = compare(client, self.parent_id, self.metric, Path(config.hydra.sweep.dir))
            print(f"\nSweep results (sorted by {self.metric}):\n{text}\nreward curves: {png}")
        finally:
            client.set_terminated(self.parent_id, "FINISHED")
        failed = [line for line in text.splitlines()[2:] if " | FAILED " in line]
        if failed:
            raise SystemExit(f"{len(failed)} job(s) of the sweep failed (status FAILED above; their logs are in "
                             f"{config.hydra.sweep.dir}).")
