"""Read a run's episode ledger (`<run dir>/episodes.jsonl`, see tracking/ledger.py).

    python -m grpo_pipeline episodes <run dir>   # per split and step: n, mean reward, failures, masked
    python -m grpo_pipeline episodes <run dir> --show [--split train] [--steps 3:7] [--min-score 0.5]
                                              [--max-score 0.2] [--failures] [--limit 20] [--full]
    python -m grpo_pipeline episodes <run dir> --prompt <prompt id>   # one prompt's completions, first vs last step

Prompt ids are in every listing (the same prompt has the same id in every run).
"""

if __name__ == "__main__":  # before anything else is imported (tools/launch_path.py)
    from grpo_pipeline.tools.launch_path import drop_launch_dir

    drop_launch_dir()


import argparse
import statistics
import sys
from pathlib import Path

from grpo_pipeline.tracking.ledger import FILE, read

SPLIT_ORDER = {"test_before": 0, "train": 1, "val": 2, "test_after": 3}


def load(run: str) -> list[dict]:
    path = Path(run)
    path = path if path.suffix == ".jsonl" else path / FILE
    if not path.exists():
        raise SystemExit(f"ERROR: no episode ledger at {path} (runs write one unless ledger.enabled=false).")
    return read(path)


def select(entries: list[dict], split: str | None = None, steps: str | None = None, min_score: float | None = None,
           max_score: float | None = None, failures: bool = False, prompt: str | None = None) -> list[dict]:
    low, high = _steps(steps)
    out = []
    for e in entries:
        reward = e.get("reward")
        if ((split and e["split"] != split) or not low <= e["step"] <= high
                or (min_score is not None and (reward is None or reward < min_score))
                or (max_score is not None and (reward is None or reward > max_score))
                or (failures and not e.get("failure")) or (prompt and not e["prompt_id"].startswith(prompt))):
            continue
        out.append(e)
    return out


def _steps(spec: str | None) -> tuple[float, float]:
    if not spec:
        return -float("inf"), float("inf")
    first, sep, last = spec.partition(":")
    if not sep:
        return int(first), int(first)
    return (int(first) if first else -float("inf")), (int(last) if last else float("inf"))


def by_step(entries: list[dict]) -> list[tuple[str, int, list[int]]]:
    """(split, step, indices of its entries), in run order: test_before, train steps, validations, test_after."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(entries):
        groups.setdefault((SPLIT_ORDER.get(e["split"], 9), e["split"], e["step"]), []).append(i)
    return [(split, step, idx) for (_, split, step), idx in sorted(groups.items())]


def summary(entries: list[dict]) -> str:
    """Per split and step: episodes, mean reward, failures, and (train, under loss.mask_truncated_completions) how
    many TRL kept out of the loss whole (cut by the token budget; see tracking/ledger.py)."""
    lines = [f"{'split':<12} {'step':>5} {'episodes':>8} {'mean reward':>11} {'failures':>8} {'masked':>6}"]
    for split, step, idx in by_step(entries):
        group = [entries[i] for i in idx]
        rewards = [e["reward"] for e in group if e.get("reward") is not None]
        mean = f"{statistics.fmean(rewards):.3f}" if rewards else "-"
        masked = sum(bool(e.get("masked")) for e in group) if any("masked" in e for e in group) else "-"
        lines.append(f"{split:<12} {step:>5} {len(group):>8} {mean:>11} "
                     f"{sum(bool(e.get('failure')) for e in group):>8} {masked:>6}")
    return "\n".join(lines)


def show(e: dict, full: bool = False) -> str:
    parts = " ".join(f"{k}={v:.2f}" for k, v in (e.get("rewards") or {}).items() if v is not None)
    head = (f"[{e['split']} step {e['step']}] prompt {e['prompt_id']}  reward "
            f"{'-' if e.get('reward') is None else format(e['reward'], '.3f')} ({parts})")
    if e.get("advantage") is not None:
        head += f"  advantage {e['advantage']:+.3f}"
    if e.get("seconds") is not None:
        head += f"  {e['seconds']:.2f}s"
    if e.get("masked"):
        head += "  MASKED (cut by the token budget: kept out of the loss)"
    if e.get("failure"):
        head += f"\n  FAILED: {e['failure']}"
    text = e["completion"] if full else _short(e["completion"], 400)
    body = "\n".join("    " + line for line in text.splitlines()) or "    (empty)"
    if full:
        prompt = "\n".join("  | " + line for line in e["prompt"].splitlines())
        return f"{head}\n  row: {e.get('row')}\n{prompt}\n{body}"
    return f"{head}\n{body}"


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f" ... (+{len(text) - limit} chars)"


def prompt_history(entries: list[dict], prompt: str, full: bool = False) -> str:
    """Every recorded episode of one prompt, by split and step; first and last step side by side."""
    mine = sorted(select(entries, prompt=prompt), key=lambda e: (e["step"], SPLIT_ORDER.get(e["split"], 9)))
    if not mine:
        return f"no episode with prompt id {prompt}"
    ids = {e["prompt_id"] for e in mine}
    if len(ids) > 1:
        return f"prompt id {prompt} is ambiguous: {sorted(ids)}"
    lines = [f"prompt {mine[0]['prompt_id']} (as the model saw it, end):", _short(mine[0]["prompt"][-600:], 600), ""]
    by_step: dict[tuple, list[dict]] = {}
    for e in mine:
        by_step.setdefault((e["step"], e["split"]), []).append(e)
    for (step, split), group in by_step.items():
        rewards = [e["reward"] for e in group if e.get("reward") is not None]
        lines.append(f"{split} step {step}: {len(group)} episode(s), mean reward "
                     f"{statistics.fmean(rewards):.3f}" if rewards else f"{split} step {step}: {len(group)} episode(s)")
    keys = list(by_step)
    for label, key in (("FIRST", keys[0]), ("LAST", keys[-1])) if len(keys) > 1 else (("ONLY", keys[0]),):
        lines.append(f"\n== {label}: {key[1]} step {key[0]}")
        lines += [show(e, full) for e in by_step[key]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run dir (or its episodes.jsonl)")
    parser.add_argument("--show", action="store_true", help="print the episodes that match, not the summary")
    parser.add_argument("--split", choices=sorted(SPLIT_ORDER))
    parser.add_argument("--steps", help="a step (5) or a range (3:7, :10, 20:)")
    parser.add_argument("--min-score", type=float)
    parser.add_argument("--max-score", type=float)
    parser.add_argument("--failures", action="store_true", help="only failed or timed-out episodes")
    parser.add_argument("--prompt", help="a prompt id (or its start): its completions from the first to the last step")
    parser.add_argument("--limit", type=int, default=20, help="episodes printed with --show (0: all)")
    parser.add_argument("--full", action="store_true", help="whole texts, the prompt and the row")
    args = parser.parse_args(argv)
    entries = load(args.run)
    if args.prompt:
        print(prompt_history(entries, args.prompt, args.full))
        return
    chosen = select(entries, args.split, args.steps, args.min_score, args.max_score, args.failures)
    filtered = any([args.split, args.steps, args.min_score is not None, args.max_score is not None, args.failures])
    if not args.show and not filtered:
        print(summary(chosen))
        return
    limit = args.limit or len(chosen)
    for e in chosen[:limit]:
        print(show(e, args.full))
    print(f"\n{len(chosen)} episode(s) matched" + (f", {limit} shown (--limit)" if len(chosen) > limit else ""),
          file=sys.stderr)


if __name__ == "__main__":
    main()
