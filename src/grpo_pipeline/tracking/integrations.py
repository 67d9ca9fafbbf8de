"""tracking.report_to: TensorBoard and Weights & Biases beside MLflow, through transformers' own integrations.

`config/grpo_args.py` passes the list as TrainingArguments.report_to, so transformers builds its
TensorBoardCallback / WandbCallback; here they are pointed at the run dir (transformers 5.25 would write
TensorBoard events under output_dir, which is our checkpoints/ folder, and wandb files in the launch dir):
- tensorboard: `<run dir>/tensorboard` (`tensorboard --logdir <run dir>/tensorboard`); TRL's metrics appear as
  `train/reward`, `train/kl`, `train/entropy`, ...
- wandb: offline unless WANDB_MODE is set, files in `<run dir>/wandb` unless WANDB_DIR is set, project =
  tracking.experiment_name unless WANDB_PROJECT is set (`wandb sync <run dir>/wandb/offline-run-*` uploads it).
  The environment is set only while wandb starts its run, so two runs in one process do not share it.
MLflow stays the pipeline's store (tracking/mlflow_run.py): it is never among these callbacks.
"""

import contextlib
import os
from pathlib import Path

from transformers.integrations import TensorBoardCallback, WandbCallback

TENSORBOARD_DIR = "tensorboard"


def point_at_run_dir(trainer, run_dir: Path, project: str) -> None:
    """Send the trainer's TensorBoard and wandb callbacks (built from report_to) to the run dir."""
    for callback in list(trainer.callback_handler.callbacks):
        if isinstance(callback, TensorBoardCallback):
            callback.logging_dir = str(run_dir / TENSORBOARD_DIR)
        elif type(callback) is WandbCallback:
            trainer.remove_callback(callback)
            trainer.add_callback(RunDirWandb(run_dir, project))


class RunDirWandb(WandbCallback):
    """transformers' WandbCallback, whose run starts offline in the run dir and finishes when training ends."""

    def __init__(self, run_dir: Path, project: str):
        super().__init__()
        self.run_dir, self.project = run_dir, project

    def setup(self, args, state, model, **kwargs):
        with _default_env(WANDB_MODE="offline", WANDB_DIR=str(self.run_dir), WANDB_PROJECT=self.project):
            super().setup(args, state, model, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        if state.is_world_process_zero and self._wandb is not None and self._wandb.run is not None:
            self._wandb.finish()  # the next run in this process starts its own


@contextlib.contextmanager
def _default_env(**values: str):
    """Set the variables the user has not set, for the block only."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
