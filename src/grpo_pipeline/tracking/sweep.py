"""Hydra multirun as first-class sweeps: a parent MLflow run per sweep, one child run per job, and a
comparison (table + reward-curve PNG) at the end, logged to the parent.

Registered in conf/train.yaml under hydra.callbacks, so `python -m grpo_pipeline -m loss.kl_coef=0,0.1`
and `+sweep=kl_x_generations` get it. Jobs find the parent through `<sweep dir>/sweep_parent_run_id`
(so it also works for launchers that run jobs in other processes).

- A failed job is a FAILED child run with an `error` tag, also when it failed before its run existed
  (a bad config): `job_failed` makes one. The job returns None, which Optuna counts as a failed trial
  without stopping the study (NaN would make hydra-optuna-sweeper 1.3 abort it). The sweep exits 1.
- SIGINT/SIGTERM stop the whole sweep: the running job's run is KILLED (the recipe marks it), no further
  job starts, the parent is KILLED and the command exits 130/143.
- The parent run is closed in every case: FINISHED at the end, else (a crash in the sweeper, all Optuna
  trials failed, a signal) FAILED or KILLED when the process exits.
"""

import atexit
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from grpo_pipeline.tracking.redact import mask_override, mask_secrets, redact_log_records, register_overrides

log = logging.getLogger(__name__)
PARENT_FILE = "sweep_parent_run_id"
KEYS_FILE = "sweep_keys.json"
_SWEEP_SYNTAX = ("range(", "choice(", "interval(", "glob(", "tag(")
_stopped: dict[str, int] = {}  # "exit_code" once a signal stopped the sweep (this process)


class SweepInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM outside the training loop of a job (a KeyboardInterrupt, so the recipe marks the
    job's run KILLED)."""

    def __init__(self, signum: int):
        super().__init__(f"Stopped by signal {signum} ({signal.Signals(signum).name}).")
        self.exit_code = 128 + signum


def _client_and_experiment(config: DictConfig):
    from grpo_pipeline.tracking.mlflow_run import Tracker

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
    tags = {"sweep_id": mask_secrets(str(sweep_dir))}
    parent = Path(sweep_dir) / PARENT_FILE
    if parent.exists():
        tags["mlflow.parentRunId"] = parent.read_text().strip()
    keys_file = Path(sweep_dir) / KEYS_FILE
    name = None
    if keys_file.exists():
        keys = set(json.loads(keys_file.read_text()))
        name = ",".join(mask_override(o) for o in overrides if o.partition("=")[0].lstrip("+~") in keys) or None
    return tags, name


def error_line(error: BaseException) -> str:
    """The error's first line, masked. A header ('Invalid config:', 'X.score_episode raised:') gets what
    follows it: the first item, or the exception line that ends an embedded traceback."""
    lines = [line.rstrip() for line in str(error).splitlines() if line.strip()] or [error.__class__.__name__]
    line = lines[0].strip()
    if line.endswith(":") and len(lines) > 1:
        rest = lines[1:]
        if rest[0].startswith("Traceback"):
            detail = next((x for x in rest[1:] if not x.startswith(" ")), rest[-1])
        else:
            detail = rest[0].strip().lstrip("- ")
        line = f"{line} {detail.strip()}"
    return mask_secrets(line)[:500]


def _stop_exit_code(error: BaseException) -> int | None:
    """128 + the signal number when `error` means SIGINT/SIGTERM stopped the job, else None."""
    from grpo_pipeline.training.checkpoints import TrainingStopped

    if isinstance(error, TrainingStopped) and getattr(error, "exit_code", 0) > 128:  # 3: tracking gave up
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return getattr(error, "exit_code", 128 + signal.SIGINT)
    return None


def job_failed(cfg: DictConfig, error: BaseException) -> None:
    """Called by a sweep job that raised. A signal stops the whole sweep (SystemExit 130/143); any other
    error is recorded as a FAILED child run of the sweep and the job returns None, so the sweep goes on."""
    hydra_cfg = HydraConfig.get()
    first_line = error_line(error)
    exit_code = _stop_exit_code(error)
    if exit_code is not None:
        _stopped["exit_code"] = exit_code
        print(f"\n{mask_secrets(str(error)) or 'Interrupted.'}\nThe sweep stops: job {hydra_cfg.job.num} was "
              f"interrupted (exit {exit_code}); no further job starts. Sweep dir: {hydra_cfg.sweep.dir}", file=sys.stderr)
        raise SystemExit(exit_code)
    log.error("Job %s failed: %s", hydra_cfg.job.num, mask_secrets(str(error) or repr(error)),
              exc_info=bool(os.environ.get("GRPO_PIPELINE_TRACEBACK")))
    parent_file = Path(hydra_cfg.sweep.dir) / PARENT_FILE
    if not cfg.tracking.enabled or not parent_file.exists():
        return None
    try:
        _record_failure(cfg, parent_file.read_text().strip(), list(hydra_cfg.overrides.task), first_line)
    except Exception as e:  # e.g. the tracking config itself is what is broken
        log.error("Could not record the failed job %s in MLflow: %s", hydra_cfg.job.num,
                  mask_secrets(str(e).splitlines()[0] if str(e) else repr(e)))
    return None  # the value Optuna counts as a failed trial without stopping the study


def _record_failure(cfg: DictConfig, parent_id: str, overrides: list[str], error: str) -> None:
    """Tag the job's own run with the error, or create a FAILED child run when the job failed before the
    recipe made one (bad config, broken env)."""
    from mlflow.entities import Param

    from grpo_pipeline.training.checkpoints import RUN_ID_FILE

    client, experiment_id = _client_and_experiment(cfg)
    id_file = Path(cfg.output_dir) / RUN_ID_FILE
    if id_file.exists():  # written right after the recipe creates the run; may be left from an older sweep
        try:
            run = client.get_run(id_file.read_text().strip())
        except Exception:  # a run of another store
            run = None
        if run is not None and run.data.tags.get("mlflow.parentRunId") == parent_id:
            client.set_tag(run.info.run_id, "error", error)  # the recipe's own tag may be a bare header line
            return
    tags, name = sweep_job(str(HydraConfig.get().sweep.dir), overrides)
    overrides = [mask_override(o) for o in overrides]
    tags |= {"overrides": mask_secrets(" ".join(overrides))[:5000], "error": error}
    run = client.create_run(experiment_id, run_name=mask_secrets(name or ",".join(overrides) or "job")[:250],
                            tags=tags)
    params = dict(o.lstrip("+~").partition("=")[::2] for o in overrides if "=" in o)
    client.log_batch(run.info.run_id, params=[Param(k, mask_secrets(v)[:6000]) for k, v in params.items()])
    client.set_terminated(run.info.run_id, "FAILED")


class SweepCallback(Callback):
    def __init__(self, metric: str = "reward"):
        self.metric = metric
        self.parent_id: str | None = None
        self._config: DictConfig | None = None
        self._in_job = False
        self._previous_handlers: dict[int, object] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        register_overrides(list(config.hydra.overrides.task))
        redact_log_records()  # Hydra logs each job's overrides ("#0 : ...") before any job runs
        if not config.tracking.enabled:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        client, experiment_id = _client_and_experiment(config)
        overrides = mask_secrets(" ".join(mask_override(o) for o in config.hydra.overrides.task))
        run = client.create_run(experiment_id, run_name=f"sweep {sweep_dir.name}: {overrides}"[:250],
                                tags={"sweep_id": mask_secrets(str(sweep_dir)), "sweep_role": "parent",
                                      "overrides": overrides[:5000]})
        self.parent_id, self._config = run.info.run_id, config
        (sweep_dir / PARENT_FILE).write_text(self.parent_id)
        params = config.hydra.sweeper.get("params")
        keys = swept_keys(list(config.hydra.overrides.task), dict(params) if params else None)
        (sweep_dir / KEYS_FILE).write_text(json.dumps(keys))
        atexit.register(self._close_at_exit)
        self._install_signal_handlers()

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        self._in_job = True

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        self._in_job = False

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if not self.parent_id:
            return
        self._restore_signal_handlers()
        items = self._finish("FINISHED")
        failed = [item for item in items if item["status"] == "FAILED"]
        if failed:
            raise SystemExit(f"{len(failed)} job(s) of the sweep failed (status FAILED above; their logs are in "
                             f"{config.hydra.sweep.dir}).")

    def _finish(self, status: str) -> list[dict]:
        """Compare the jobs, log the table and plot to the parent, close it; once."""
        from grpo_pipeline.tools.compare import compare

        parent_id, self.parent_id = self.parent_id, None
        client, _ = _client_and_experiment(self._config)
        items: list[dict] = []
        try:
            text, png, items = compare(client, parent_id, self.metric, Path(self._config.hydra.sweep.dir))
            print(f"\nSweep results (sorted by {self.metric}):\n{text}\nreward curves: {png}")
        except Exception as e:
            log.error("Could not compare the sweep's jobs: %s", mask_secrets(str(e)))
        finally:
            client.set_terminated(parent_id, status)
        return items

    def _close_at_exit(self) -> None:
        """The parent is still open when the process exits without on_multirun_end: a signal stopped the
        sweep (KILLED), or the sweeper raised, e.g. Optuna when every trial failed (FAILED)."""
        if not self.parent_id:
            return
        self._restore_signal_handlers()  # a second Ctrl-C while closing acts as usual
        interrupted = "exit_code" in _stopped or isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
        status = "KILLED" if interrupted else "FAILED"
        log.warning("The sweep ended early; its parent MLflow run is marked %s.", status)
        try:
            self._finish(status)
        except Exception as e:
            log.error("Could not close the sweep's parent run: %s", mask_secrets(str(e)))

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        """A signal outside a job's training loop (the recipe handles it there): stop now."""
        _stopped["exit_code"] = 128 + signum
        if self._in_job:  # the job's run is marked KILLED on the way out, then job_failed exits
            raise SweepInterrupted(signum)
        raise SystemExit(128 + signum)
