"""Crash safety: finding the checkpoint to resume from, and stopping cleanly on SIGINT/SIGTERM.

Checkpoints are TRL/transformers Trainer checkpoints (`<run dir>/checkpoints/checkpoint-<step>`, every
`training.save_steps`, the last `training.save_total_limit` kept): weights or adapter, optimizer,
scheduler, RNG states and the data position, so a resumed run continues at the same global step.
"""

import re
import signal
import threading
from pathlib import Path

from transformers import TrainerCallback

from grpo_pipeline.errors import ConfigError, PipelineError

RUN_ID_FILE = "mlflow_run_id"


class TrainingStopped(PipelineError):
    """The run was stopped by a signal after saving a checkpoint."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in (run_dir / "checkpoints").glob("checkpoint-*")
             if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and (p / "trainer_state.json").exists()]
    return max(found)[1] if found else None


def resolve_resume(resume: str | None, output_dir: str) -> tuple[Path, Path | None]:
    """(run dir, checkpoint to resume from). resume: null | auto | <run dir of an earlier run>."""
    if resume is None:
        return Path(output_dir), None
    if resume == "auto":  # continue this run dir if it has a checkpoint (e.g. a requeued Slurm job)
        return Path(output_dir), latest_checkpoint(Path(output_dir))
    run_dir = Path(resume)
    if not run_dir.is_dir():
        raise ConfigError(f"resume={resume!r} is not a directory. Pass the run dir of an earlier run "
                          "(outputs/runs/<date>/<time>), or resume=auto.")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise ConfigError(f"resume={resume!r} has no checkpoint under {run_dir / 'checkpoints'}. Runs save "
                          "checkpoints only with training.save_steps > 0.")
    return run_dir, checkpoint


class GracefulStop(TrainerCallback):
    """On SIGINT/SIGTERM: finish the current step, save a checkpoint, stop training."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now
            self.uninstall()
            raise KeyboardInterrupt
        self.signum = signum

    def on_step_end(self, args, state, control, **kwargs):
        if self.signum is not None:
            control.should_save = True
            control.should_training_stop = True
        return control
