"""MLflow tracking (one run per Hydra job) and the per-step console line.

We talk to MLflow through an explicit `MlflowClient` (no fluent API, no global active run), so two
trainings in one process never share state. The default store is SQLite under `outputs/` (MLflow 3
refuses a plain file store); artifacts go to `outputs/mlartifacts`. Open the UI with:

    mlflow ui --backend-store-uri sqlite:///outputs/mlflow.db
"""

import math
import os
import re
import time
from pathlib import Path
from typing import Any

from transformers.trainer_callback import ProgressCallback

from grpo_pipeline.config.schema import TrackingConfig
from grpo_pipeline.errors import ConfigError

_MAX_PARAM_LEN = 500


def default_tracking_uri(launch_dir: str | Path) -> str:
    return f"sqlite:///{Path(launch_dir).resolve() / 'outputs' / 'mlflow.db'}"


_URL_CREDENTIALS = re.compile(r"://[^/@\s]+@")


def mask_credentials(text: str) -> str:
    """scheme://user:password@host -> scheme://***@host"""
    return _URL_CREDENTIALS.sub("://***@", text)


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """{'loss': {'kl_coef': 0.1}} -> {'loss.kl_coef': '0.1'}: the params of a run. Credentials inside
    URLs (scheme://user:password@host) are masked, so they never reach MLflow."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): mask_credentials(str(node))[:_MAX_PARAM_LEN]}


class Tracker:
    """One MLflow run. With tracking disabled every method is a no-op."""

    FLUSH_SECONDS = 10.0

    def __init__(self, cfg: TrackingConfig, launch_dir: str | Path, enabled: bool = True):
        self.enabled = cfg.enabled and enabled
        self.run_id: str | None = None
        self._buffer: list = []
        self._flushed = time.monotonic()
        if not self.enabled:
            return
        from mlflow.tracking import MlflowClient

        self.uri = cfg.tracking_uri or default_tracking_uri(launch_dir)
        # Fail in seconds, not after minutes of retries, when a tracking server is unreachable.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        artifacts = None
        try:
            if self.uri.startswith("sqlite:///"):  # a local store: artifacts go next to the database
                db_dir = Path(self.uri.removeprefix("sqlite:///")).resolve().parent
                db_dir.mkdir(parents=True, exist_ok=True)
                artifacts = (db_dir / "mlartifacts").as_uri()
            self.client = MlflowClient(tracking_uri=self.uri)
            experiment = self.client.get_experiment_by_name(cfg.experiment_name)
            if experiment is None:
                self.experiment_id = self.client.create_experiment(cfg.experiment_name, artifact_location=artifacts)
            else:
                self.experiment_id = experiment.experiment_id
        except Exception as e:
            raise ConfigError(
                f"tracking.tracking_uri='{self.uri}' is not usable ({e.__class__.__name__}: {str(e)[:300]}). "
                "Fix the URI (e.g. sqlite:///outputs/mlflow.db or http://host:5000), or set tracking.enabled=false."
            ) from e

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str] | None = None) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags or {})
        self.run_id = run.info.run_id
        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def resume(self, run_id: str) -> None:
        """Continue an earlier run (after a crash): metrics go on from the checkpoint's step."""
        if not self.enabled:
            return
        self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffered: written every FLUSH_SECONDS, at checkpoints and at the end (a sqlite write per step
        would cost ~9 ms, a visible share of a small model's step)."""
        if not self.run_id:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer += [Metric(_metric_key(k), v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        if time.monotonic() - self._flushed >= self.FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self.run_id and self._buffer:
            for i in range(0, len(self._buffer), 1000):
                self.client.log_batch(self.run_id, metrics=self._buffer[i : i + 1000])
        self._buffer = []
        self._flushed = time.monotonic()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.run_id and os.path.exists(path):
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        if self.run_id:
            self.flush()
            self.client.set_terminated(self.run_id, status)


def _metric_key(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def numeric(logs: dict) -> dict[str, float]:
    return {k: float(v) for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class RunLogger(ProgressCallback):
    """Keeps the progress bar; per logging step prints one readable line and logs metrics to MLflow."""

    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tracker = tracker

    def on_save(self, args, state, control, **kwargs):
        self.tracker.flush()  # a resumed run continues from the checkpoint with every metric before it

    def on_train_end(self, args, state, control, **kwargs):
        self.tracker.flush()
        return super().on_train_end(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = numeric(logs or {})
        self.tracker.log_metrics(metrics, step=state.global_step)
        if "reward" not in metrics:
            return
        parts = [
            f"epoch {metrics.get('epoch', 0):.2f}/{state.num_train_epochs:g}",
            f"step {state.global_step}/{state.max_steps}",
            f"reward {metrics['reward']:.3f}",
        ]
        parts += [f"{key} {metrics[key]:.4g}" for key in ("kl", "loss") if key in metrics]
        if "completions/mean_length" in metrics:
            parts.append(f"len {metrics['completions/mean_length']:.1f}")
        if metrics.get("env/failures"):
            parts.append(f"env failures {metrics['env/failures']:.0f}")
        line = " | ".join(parts)
        if state.is_world_process_zero:
            (self.training_bar.write if self.training_bar is not None else print)(line)

