"""The episode ledger: every episode of a run, training and held-out, one JSON line each.

`<run dir>/episodes.jsonl` is appended as the run goes (a killed run keeps what it wrote; a resumed run
first drops the lines of steps after its checkpoint, so every step is in it once). At the end of the run
the ledger also goes to MLflow as a table (artifact `episodes.json`, shown as a table in the run's
artifact view; at most `ledger.mlflow_max_rows` rows, every held-out episode kept).

A line: `split` (train | val | test_before | test_after), `step` (the training step the episode was
generated for; held-out: the step evaluated), `prompt_id` (sha1 of the prompt, 10 hex digits: the same
prompt has the same id in every run), `prompt` (as the model saw it), `completion` (a multi-turn episode:
every turn, `[role] content` per message; `messages` has them as a list), `reward` (the total GRPO saw), `rewards` (each component),
`advantage` (train), `row` (the env's extra columns), `seconds` (scoring), `failure` (first line of the
error, or null), `masked` (train, under loss.mask_truncated_completions: true when TRL kept the completion out of
the loss whole, for running to the token budget without EOS; a `respond` episode is one completion, so all its turns,
decided by the last one; a seed-style env's own later turns still train; it still counted in its group's baseline), `turns` (train, where it applies: runtime.turn_credit=turn, each assistant turn's `score` and
`advantage`; a seed-style env, `sampled`, the turns its own generate calls sampled and training trained). Read it with `python -m grpo_pipeline episodes <run dir>`.
"""

import hashlib
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

from grpo_pipeline.tracking.redact import mask_secrets

FILE = "episodes.jsonl"
log = logging.getLogger(__name__)


def prompt_id(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def transcript_text(messages: list[dict]) -> str:
    return "\n".join(f"[{m.get('role')}] {m.get('content') or ''}" for m in messages)




def _number(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else round(x, 6)


class Ledger:
    def __init__(self, run_dir: Path, tokenizer, max_per_step: int, max_chars: int, seed: int = 0):
        self.path = Path(run_dir) / FILE
        self.tokenizer, self.max_per_step, self.max_chars = tokenizer, max_per_step, max_chars
        self.rng = random.Random(seed)
        self.seconds = 0.0  # time spent recording: its cost, reported at the end

    def truncate_after(self, step: int) -> int:
        """Resume: drop training/validation lines of steps after `step` and any final test (they run again).
        Returns how many lines were dropped."""
        if not self.path.exists():
            return 0
        keep, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line a kill cut short
                dropped += 1
                continue
            if entry["split"] == "test_after" or (entry["split"] in ("train", "val") and entry["step"] > step):
                dropped += 1
            else:
                keep.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        tmp.replace(self.path)
        return dropped

    def record(self, split: str, step: int, prompts: list, completions: list, rewards: dict[str, list],
               totals: list | None = None, advantages: list | None = None, rows: list | None = None,
               seconds: list | None = None, failures: list | None = None, transcripts: bool = False,
               turns: list | None = None, masked: list | None = None) -> None:
        """One batch. `completions`: texts (or TRL's chat completions); with `transcripts`, a multi-turn
        episode's messages after the opening each (kept as `messages` too, for rescoring)."""
        from grpo_pipeline.envs.runner import completion_text

        started = time.monotonic()
        ids = [prompt_id(p) for p in prompts]
        chosen = range(len(prompts))
        if split == "train" and len(prompts) > self.max_per_step:  # a seeded sample of whole groups, in order
            groups = list(dict.fromkeys(ids))
            per_group = max(1, len(prompts) // len(groups))
            keep = set(self.rng.sample(groups, max(1, self.max_per_step // per_group)))
            chosen = [i for i, pid in enumerate(ids) if pid in keep]
        rendered: dict[str, str] = {}
        lines = []
        for i in chosen:
            pid = ids[i]
            if pid not in rendered:
                rendered[pid] = self._seen_as(prompts[i])
            parts = {name: _number(values[i]) for name, values in rewards.items()}
            # the text the env scored (TRL's chat completion -> its assistant text); a multi-turn episode: every turn
            text = transcript_text(completions[i]) if transcripts else completion_text(completions[i])
            entry = {
                "split": split, "step": step, "prompt_id": pid, "prompt": rendered[pid],
                "completion": text[: self.max_chars],
                "truncated": len(text) > self.max_chars,  # rescore skips these: the text is not what was scored
                "messages": completions[i] if transcripts else None,
                "reward": _number(totals[i]) if totals is not None else parts.get("env"),
                "rewards": parts,
                "advantage": _number(advantages[i]) if advantages is not None else None,
                "row": rows[i] if rows is not None else None,
                "seconds": _number(seconds[i]) if seconds is not None else None,
                "failure": (failures[i] or None) if failures is not None else None,
            }
            if turns is not None and len(turns) == len(prompts):
                entry["turns"] = turns[i]
            if masked is not None and len(masked) == len(prompts):
                entry["masked"] = bool(masked[i])
            lines.append(mask_secrets(json.dumps(entry, default=str)))
        with self.path.open("a") as f:  # one write per batch; a kill mid-write leaves one cut line at most
            f.write("".join(line + "\n" for line in lines))
        self.seconds += time.monotonic() - started

    def _seen_as(self, prompt: Any) -> str:
        from grpo_pipeline.prompts import render_prompt

        try:
            text = render_prompt(self.tokenizer, prompt)[0]
        except Exception:  # a prompt the template cannot render is still worth seeing
            text = prompt if isinstance(prompt, str) else transcript_text(prompt)
        return text[-self.max_chars :]  # the end of a long prompt is the part that differs

    def log_to_mlflow(self, tracker, max_rows: int) -> int:
        """The ledger as an MLflow table (artifact episodes.json). Returns the rows logged; a failure is a
        warning (the run's results are already safe), never an error."""
        entries = read(self.path)
        if not entries or not tracker.run_id:
            return 0
        held = [e for e in entries if e["split"] != "train"]
        train = [e for e in entries if e["split"] == "train"]
        room = max(0, max_rows - len(held))
        if len(train) > room:
            train = [train[i] for i in sorted(random.Random(0).sample(range(len(train)), room))]
        rows = held + train
        columns = ["split", "step", "prompt_id", "reward", "completion", "failure", "seconds", "advantage",
                   "prompt", "rewards", "row"]
        data = {c: [json.dumps(e[c], default=str) if c in ("rewards", "row") else e[c] for e in rows]
                for c in columns}
        try:
            tracker.log_table(data, "episodes.json")
        except Exception as e:
            log.warning("episode ledger: could not log the MLflow table (%s); %s has every episode",
                        str(e).splitlines()[0] if str(e) else type(e).__name__, self.path)
            return 0
        return len(rows)


def read(path: Path) -> list[dict]:
    """The ledger's entries; a line a kill cut short is skipped."""
    out = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def heldout_scores(path: Path, split: str, prompts: list) -> list[float] | None:
    """The scores a held-out split (e.g. test_before) recorded, one per prompt, in the order of `prompts`; None if
    the ledger lacks any of them (a held-out set holds each prompt once)."""
    recorded = {e["prompt_id"]: e["reward"] for e in read(path) if e["split"] == split}
    scores = [recorded.get(prompt_id(p)) for p in prompts]
    return None if not scores or any(s is None for s in scores) else scores
