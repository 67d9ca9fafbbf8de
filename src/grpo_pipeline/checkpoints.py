"""Finding the checkpoint to resume from.

Checkpoints are TRL/transformers Trainer checkpoints (`<run dir>/checkpoints/checkpoint-<step>`, every
`training.save_steps`, the last `training.save_total_limit` kept): weights or adapter, optimizer,
scheduler, RNG states and the data position, so a resumed run continues at the same global step.
`trainer_state.json` is the last file a checkpoint gets: a checkpoint counts only when that file parses
and names its step. A folder a kill left half-written is removed on resume, never loaded.
"""

import json
import logging
import re
import shutil
from pathlib import Path

from grpo_pipeline.errors import ConfigError, PipelineError

log = logging.getLogger(__name__)
RUN_ID_FILE = "mlflow_run_id"


class TrainingStopped(PipelineError):
    """The run was stopped (signal, tracking outage) after saving a checkpoint."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _step(path: Path) -> int | None:
    m = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(m.group(1)) if m else None


def is_complete(checkpoint: Path) -> bool:
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return state.get("global_step") == _step(checkpoint)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = [(step, p) for p in (run_dir / "checkpoints").glob("checkpoint-*")
             if (step := _step(p)) is not None and is_complete(p)]
    return max(found)[1] if found else None


def remove_incomplete(run_dir: Path) -> None:
    """Remove the checkpoint folders that a kill left half-written."""
    for p in (run_dir / "checkpoints").glob("checkpoint-*"):
        if _step(p) is not None and not is_complete(p):
            log.warning("Removing %s: a kill left it half-written (no valid trainer_state.json).", p)
            shutil.rmtree(p, ignore_errors=True)


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
        raise ConfigError(f"resume={resume!r} has no complete checkpoint under {run_dir / 'checkpoints'}. Runs save "
                          "checkpoints only with training.save_steps > 0.")
    return run_dir, checkpoint
