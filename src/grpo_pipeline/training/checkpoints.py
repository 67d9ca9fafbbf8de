"""Checkpoints: which one a resume may load, and when one counts as written.

Checkpoints are TRL/transformers Trainer checkpoints (`<run dir>/checkpoints/checkpoint-<step>`, every
`training.save_steps`): weights or adapter, optimizer, scheduler, RNG states and the data position, so a resumed
run continues at the same global step. A checkpoint counts only once `CheckpointMarker` has written its marker
(`run_checkpoint.json`: the run's id and the step), after every process finished its part and the files were
fsync'd; a folder without it (a kill mid-save) is removed on resume, never loaded. The marker's run id must be the
run dir's own (`run.json`), so a resume never continues another run's checkpoint. The marker callback also keeps
the last `training.save_total_limit` marked checkpoints (transformers' own rotation would delete the older one
before the new one is marked).
"""

import json
import logging
import os
import re
import shutil
from pathlib import Path

from transformers.trainer_callback import TrainerCallback

from grpo_pipeline.errors import PipelineError

log = logging.getLogger(__name__)
RUN_ID_FILE = "mlflow_run_id"
MARKER = "run_checkpoint.json"


class TrainingStopped(PipelineError):
    """The run was stopped (signal, tracking outage) after saving a checkpoint."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def step_of(path: Path) -> int | None:
    m = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(m.group(1)) if m else None


def marker_of(checkpoint: Path) -> dict | None:
    try:
        marker = json.loads((checkpoint / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("step") == step_of(checkpoint) else None


def is_complete(checkpoint: Path, run_uid: str | None = None) -> bool:
    """Marked complete (by this run, when `run_uid` is given)."""
    marker = marker_of(checkpoint)
    return marker is not None and (run_uid is None or marker.get("run_uid") == run_uid)


def checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoint folders, newest step first.

    Not `transformers.trainer_utils.get_last_checkpoint`: it returns the newest `checkpoint-*` folder only, half-
    written or another run's included, where a resume needs every folder in order, to skip the unmarked and the
    foreign ones and to fall back to the next when the newest fails to load (tests/test_run_dir.py)."""
    found = [(s, p) for p in (Path(run_dir) / "checkpoints").glob("checkpoint-*") if (s := step_of(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def resumable(run_dir: Path, run_uid: str | None) -> list[Path]:
    """The complete checkpoints of run `run_uid`, newest first (a resume tries them in this order)."""
    return [p for p in checkpoints(run_dir) if is_complete(p, run_uid)]


def foreign(run_dir: Path, run_uid: str | None) -> list[Path]:
    """Complete checkpoints written by another run than `run_uid`."""
    return [p for p in checkpoints(run_dir) if is_complete(p) and not is_complete(p, run_uid)]


def remove_incomplete(run_dir: Path) -> None:
    """Remove the checkpoint folders that a kill left half-written."""
    for p in checkpoints(run_dir):
        if not is_complete(p):
            log.warning("Removing %s: a kill left it half-written (no %s).", p, MARKER)
            shutil.rmtree(p, ignore_errors=True)


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then the folders: what a crash of the machine must not lose."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(Path(root))


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - a platform without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write `text` to a temporary name, fsync, rename: a reader sees the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class CheckpointMarker(TrainerCallback):
    """After every process saved its part of checkpoint N: fsync it, write its marker, keep the last `keep`."""

    def __init__(self, run_uid: str, keep: int):
        self.run_uid, self.keep = run_uid, max(1, keep)

    def on_save(self, args, state, control, **kwargs):
        _barrier()  # every rank finished writing its shards and optimizer state
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                fsync_tree(folder)
                write_durably(folder / MARKER, json.dumps({"run_uid": self.run_uid, "step": state.global_step}))
                for old in resumable(Path(args.output_dir).parent, self.run_uid)[self.keep:]:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()  # no rank goes on (and may be killed) before the marker is on disk
        return control


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def replace_dir_durably(path: Path, write) -> None:
    """`write(tmp)` fills a temporary folder next to `path`; it is fsync'd and renamed into place, so `path` is
    the old folder or the whole new one, never half of it (the old one is kept as .<name>.old until the rename)."""
    path = Path(path)
    tmp, old = path.with_name(f".{path.name}.partial"), path.with_name(f".{path.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def load_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` would fail to load (a file cut short or corrupt), or None. Reads the trainer state, every
    safetensors header and the optimizer/scheduler/RNG files, as the resume will."""
    import torch
    from safetensors import safe_open

    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
        for path in checkpoint.glob("*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    f.get_slice(key)
        for name in ("optimizer.pt", "scheduler.pt"):
            if (checkpoint / name).exists():
                torch.load(checkpoint / name, map_location="cpu", weights_only=True, mmap=True)
        for path in checkpoint.glob("rng_state*.pth"):
            torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # any reason it cannot be read is a reason not to resume from it
        return f"{e.__class__.__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def first_loadable(candidates: list[Path]) -> Path | None:
    """The newest checkpoint that loads; each one skipped is reported."""
    for checkpoint in candidates:
        problem = load_problem(checkpoint)
        if problem is None:
            return checkpoint
        log.warning("Resume: %s fails to load (%s); falling back to the checkpoint before it.", checkpoint.name,
                    problem)
    return None
