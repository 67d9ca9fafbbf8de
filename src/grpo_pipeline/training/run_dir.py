"""One run per run dir, and a resume that runs the run's own config.

A run dir belongs to the run that first trained in it: `run.json` holds its id, the command-line overrides it
was started with (secret values masked), the launch dir and the tracking store. Then:
- a new run refuses a dir that holds another run's data (saying how to resume it or where to go instead);
  `resume=auto` in a dir whose run never reached a checkpoint moves that run's files aside into
  `previous/<its id>/` and starts afresh;
- a resume loads only its own run's checkpoints (`checkpoints.MARKER`), newest first, falling back to the one
  before when the newest fails to load;
- `resume=<run dir>` composes the run's stored overrides with the resuming command's (`resume_overrides`), and
  `check_changes` compares the result with the run's `resolved_config.yaml`: keys that are safe to change
  mid-run (`SAFE_TO_CHANGE`) are accepted, anything else is refused unless named in `resume_allow`; what
  changed is recorded in `config_changes.yaml` and the MLflow tag `config_changes`, with the step it took
  effect. `resolved_config.yaml` is never overwritten.
"""

import datetime
import fnmatch
import json
import logging
import shlex
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

from grpo_pipeline.errors import ConfigError
from grpo_pipeline.tracking.redact import MASK, mask_override
from grpo_pipeline.training.checkpoints import MARKER, RUN_ID_FILE, foreign, resumable, step_of, write_durably

log = logging.getLogger(__name__)
RUN_FILE = "run.json"
CONFIG_FILE = "resolved_config.yaml"
CHANGES_FILE = "config_changes.yaml"
# What a run writes: a dir holding any of these holds a run's data (Hydra's .hydra/ and job log are not data).
DATA = (RUN_ID_FILE, "episodes.jsonl", "checkpoints", "summary.json", "model", "model-last", "model-interrupted",
        "model_merged", "best", "metrics_unsent.jsonl", "reward_curve.png", CONFIG_FILE, CHANGES_FILE)
# Keys a resume may change without resume_allow: how long to go on, how often to log and save, how patient the
# store and the env runtime are. Nothing here changes what a step computes.
SAFE_TO_CHANGE = ("training.max_steps", "training.max_minutes", "training.logging_steps", "training.save_steps",
                  "training.save_total_limit", "training.save_model", "tracking.flush_every_s",
                  "tracking.outage_grace_s", "tracking.run_name", "tracking.secret_keys", "ledger.*",
                  "runtime.max_concurrency", "runtime.episode_timeout_s", "runtime.batch_wait_ms", "runtime.call_deadline_s",
                  "runtime.max_call_tokens", "eval.batch_size",
                  "eval.after", "check.*")
NOT_COMPARED = ("output_dir", "resume", "resume_allow")


def run_data(run_dir: Path) -> list[str]:
    """The names of run data in `run_dir` (empty folders do not count)."""
    run_dir = Path(run_dir)
    found = []
    for name in DATA:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def read_record(run_dir: Path) -> dict | None:
    try:
        record = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("uid") else None


def write_record(run_dir: Path, overrides: list[str], launch_dir: str, tracking_uri: str | None,
                 mlflow_run_id: str | None, uid: str | None = None) -> dict:
    record = {"uid": uid or uuid.uuid4().hex[:12], "created": _now(), "launch_dir": str(Path(launch_dir).resolve()),
              "overrides": [mask_override(o) for o in overrides], "tracking_uri": tracking_uri,
              "mlflow_run_id": mlflow_run_id, "python": sys.executable}
    write_durably(Path(run_dir) / RUN_FILE, json.dumps(record, indent=2))
    return record


def resume_command(run_dir: Path, record: dict | None = None) -> str:
    """The command that continues this run, as it can be pasted: from its launch dir, with this Python."""
    record = record or read_record(run_dir) or {}
    where = record.get("launch_dir")
    command = f"{shlex.quote(sys.executable)} -m grpo_pipeline resume={shlex.quote(str(Path(run_dir).resolve()))}"
    secrets = [o.partition("=")[0] for o in record.get("overrides", []) if o.partition("=")[2] == MASK]
    if secrets:  # not stored: the resuming command gives them again
        command += " " + " ".join(f"'{k}=${{oc.env:{_env_var(k)}}}'" for k in secrets)
    return f"cd {shlex.quote(where)} && {command}" if where else command


def claim(run_dir: Path, resume: str | None, main: bool = True) -> tuple[dict | None, list[Path]]:
    """(this dir's run record, its checkpoints newest first) for a run about to start in `run_dir`.
    resume=null: the dir must hold no other run's data; auto: continue the dir's run if it has a checkpoint, else
    move that run's files aside; <dir>: that run, which must have a checkpoint. Only the main process (`main`)
    refuses or moves: the others start while it already writes the new run's files."""
    run_dir = Path(run_dir)
    if resume not in (None, "auto") and not run_dir.is_dir():
        raise ConfigError(f"resume={resume!r} is not a directory. Pass the run dir of an earlier run "
                          "(outputs/runs/<date>/<time>), or resume=auto.")
    record = (_adopt_legacy(run_dir) if main else None) or read_record(run_dir)
    uid = record["uid"] if record else None
    own = resumable(run_dir, uid) if uid else []
    if resume is None:
        if main and run_data(run_dir):
            raise ConfigError(_occupied(run_dir, record))
        return None, []
    if resume == "auto" and not own:
        if main and run_data(run_dir):
            moved = move_aside(run_dir, uid)
            log.warning("resume=auto: %s holds a run that never reached a checkpoint; its files are moved to %s "
                        "and this run starts afresh.", run_dir, moved)
        return None, []
    if not own:
        others = foreign(run_dir, uid)
        why = (f"its checkpoints ({', '.join(p.name for p in others)}) belong to another run" if others else
               f"it has no complete checkpoint under {run_dir / 'checkpoints'} (runs save checkpoints only with "
               "training.save_steps > 0)")
        raise ConfigError(f"resume={resume!r} cannot continue: {why}.")
    return record, own


def move_aside(run_dir: Path, uid: str | None) -> Path:
    target = Path(run_dir) / "previous" / (uid or _now().replace(":", ""))
    target.mkdir(parents=True, exist_ok=True)
    for name in (*DATA, RUN_FILE):
        if (Path(run_dir) / name).exists():
            shutil.move(str(Path(run_dir) / name), str(target / name))
    return target


def _occupied(run_dir: Path, record: dict | None) -> str:
    what = ", ".join(run_data(run_dir))
    who = f"run {record['uid']} (started {record['created']})" if record else "an earlier run"
    fix = (f"To continue it: {resume_command(run_dir, record)}" if record and resumable(run_dir, record["uid"])
           else "It has no checkpoint to continue from; resume=auto moves its files aside and starts afresh")
    return (f"output_dir {run_dir} already holds the data of {who}: {what}. Two runs never share a run dir (their "
            f"episodes and metrics would mix). {fix}. Or start this run in a new dir (e.g. drop the fixed "
            "hydra.run.dir / output_dir).")


def _adopt_legacy(run_dir: Path) -> dict | None:
    """A run dir of a version before run.json: its valid checkpoints (trainer_state.json naming their step) get
    markers and the dir a record, once."""
    if read_record(run_dir) is not None or not (Path(run_dir) / RUN_ID_FILE).exists():
        return None
    legacy = []
    for path in (Path(run_dir) / "checkpoints").glob("checkpoint-*"):
        try:
            ok = json.loads((path / "trainer_state.json").read_text()).get("global_step") == step_of(path)
        except (OSError, ValueError):
            ok = False
        if ok and not (path / MARKER).exists():
            legacy.append(path)
    if not legacy:
        return None
    record = write_record(run_dir, [], ".", None, (Path(run_dir) / RUN_ID_FILE).read_text().strip())
    for path in legacy:
        write_durably(path / MARKER, json.dumps({"run_uid": record["uid"], "step": step_of(path)}))
    log.warning("%s: a run dir of an earlier version; its checkpoints are taken as this run's.", run_dir)
    return record


# --- the resumed config -------------------------------------------------------------------------------------------
def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def resume_overrides(record: dict, given: list[str]) -> list[str]:
    """The run's stored overrides, then the resuming command's (which win, key by key). A secret the run was
    started with is not stored: the resuming command must give it again."""
    given = [o for o in given if _key(o) not in ("resume",)]
    given_keys = {_key(o): o for o in given}
    merged = []
    for stored in record.get("overrides", []):
        key = _key(stored)
        if key in NOT_COMPARED:
            continue
        if key in given_keys:
            mine = given_keys[key]
            if stored.startswith("+") and not mine.startswith(("+", "~")):  # the key exists only with the override
                given[given.index(mine)] = "++" + mine
            continue
        if stored.partition("=")[2] == MASK:
            raise ConfigError(f"resume: {key} was a secret when the run started, and secrets are not stored. Give "
                              f"it again: '{key}=${{oc.env:{_env_var(key)}}}' (or {key}=<value>).")
        merged.append(stored)
    return merged + given


def config_changes(stored: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (stored value, new value)} for every leaf that differs (keys in NOT_COMPARED aside)."""
    flat_old, flat_new = dict(_leaves(stored)), dict(_leaves(new))
    changes = {}
    for key in sorted(set(flat_old) | set(flat_new)):
        if key.split(".")[0] in NOT_COMPARED:
            continue
        old, value = flat_old.get(key, "<absent>"), flat_new.get(key, "<absent>")
        if old != value and not (old == MASK or value == MASK):
            changes[key] = (old, value)
    return changes


def check_changes(run_dir: Path, new: dict, allow: list[str]) -> dict[str, tuple[Any, Any]]:
    """The changes a resume makes to the run's stored config; ConfigError naming each change not allowed."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        return {}
    changes = config_changes(yaml.safe_load(path.read_text()) or {}, new)
    refused = {k: v for k, v in changes.items()
               if not any(fnmatch.fnmatchcase(k, p) for p in (*SAFE_TO_CHANGE, *allow))}
    if refused:
        lines = "\n".join(f"  - {k}: {old!r} -> {value!r}" for k, (old, value) in refused.items())
        keys = ",".join(refused)
        raise ConfigError(f"resume={run_dir}: the resuming command changes the run's config:\n{lines}\nA resume runs "
                          f"the run's own config; to change these keys from the resumed step on, add "
                          f"resume_allow=[{keys}] (recorded in {CHANGES_FILE} and the MLflow tag config_changes). "
                          f"Keys that may change without it: {', '.join(SAFE_TO_CHANGE)}.")
    return changes


def record_changes(run_dir: Path, step: int, changes: dict[str, tuple[Any, Any]], tracker) -> None:
    if not changes:
        return
    path = Path(run_dir) / CHANGES_FILE
    history = (yaml.safe_load(path.read_text()) if path.exists() else None) or []
    history.append({"step": step, "at": _now(),
                    "changes": {k: {"old": old, "new": new} for k, (old, new) in changes.items()}})
    write_durably(path, yaml.safe_dump(history, sort_keys=False))
    text = "; ".join(f"step {h['step']}: " + ", ".join(f"{k} {c['old']} -> {c['new']}" for k, c in h["changes"].items())
                     for h in history)
    tracker.set_tag("config_changes", text)
    log.warning("resume: from step %d on, %s", step, ", ".join(f"{k} {o!r} -> {n!r}" for k, (o, n) in changes.items()))


def _leaves(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        if not node and prefix:
            yield prefix.rstrip("."), {}
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), node


def _env_var(key: str) -> str:
    return key.split(".")[-1].upper()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
