"""Compare runs: a table sorted by a metric and a PNG overlaying their reward curves.

    python -m grpo_pipeline.compare <sweep parent run id | experiment name> [--metric reward] [--out DIR]
        [--tracking-uri sqlite:///outputs/mlflow.db]

Given a sweep's parent run id, it compares that sweep's jobs; given an experiment name, all its runs.
A failed run shows the first line of its `error` tag. URL credentials are masked in the table and plot.
"""

import argparse
import math
from pathlib import Path

from grpo_pipeline.redact import mask_credentials
from grpo_pipeline.tracking import default_tracking_uri

COLUMNS = ("run", "status", "final reward", "held-out after", "kl", "wall s", "error")


def collect(client, target: str) -> tuple[list, str | None]:
    """(runs, parent run id or None) for a parent run id or an experiment name."""
    parent = None
    try:
        run = client.get_run(target)
        parent = run.info.run_id
        runs = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    except Exception:
        experiment = client.get_experiment_by_name(target)
        if experiment is None:
            raise SystemExit(
                f"ERROR: '{target}' is neither a run id nor an experiment name in {client.tracking_uri}") from None
        runs = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("sweep_role") != "parent"]
    return runs, parent


def rows(runs, metric: str) -> list[dict]:
    out = []
    for r in runs:
        m = r.data.metrics
        end = r.info.end_time or r.info.start_time
        out.append({
            "run": r.info.run_name or r.info.run_id[:8],
            "run_id": r.info.run_id,
            "status": r.info.status,
            "final reward": m.get("reward"),
            "held-out after": m.get("eval_after/mean_reward"),
            "kl": m.get("kl"),
            "wall s": (end - r.info.start_time) / 1000 if end else None,
            "error": (r.data.tags.get("error") or "").strip().split("\n")[0] or None,
            "sort": m.get(metric),
        })
    return sorted(out, key=lambda x: (x["sort"] is None or x["status"] != "FINISHED",
                                      -(x["sort"] if x["sort"] is not None else -math.inf)))


def table(items: list[dict]) -> str:
    def fmt(v):
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[mask_credentials(fmt(item[c])) for c in COLUMNS] for item in items]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(COLUMNS)]
    widths[-1] = len(COLUMNS[-1])  # the error, last and unpadded: one long message must not widen every row
    lines = [" | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def plot(client, items: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for item in items:
        history = sorted(client.get_metric_history(item["run_id"], "reward"), key=lambda m: m.step)
        if history:
            ax.plot([m.step for m in history], [m.value for m in history], label=mask_credentials(item["run"])[:50])
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(client, target: str, metric: str = "reward", out_dir: Path | None = None) -> tuple[str, Path, list[dict]]:
    """Print-ready table, the PNG path and the rows; table and PNG are logged to the sweep's parent run."""
    runs, parent = collect(client, target)
    items = rows(runs, metric)
    text = table(items)
    out_dir = Path(out_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "comparison.png"
    plot(client, items, png)
    (out_dir / "comparison.txt").write_text(text + "\n")
    if parent:
        client.log_artifact(parent, str(png))
        client.log_artifact(parent, str(out_dir / "comparison.txt"))
    return text, png, items


def main(argv: list[str] | None = None) -> None:
    from mlflow.tracking import MlflowClient

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="a sweep's parent run id, or an experiment name")
    parser.add_argument("--metric", default="reward", help="sort by this metric, highest first")
    parser.add_argument("--out", default="outputs/compare", help="where comparison.png/.txt go")
    parser.add_argument("--tracking-uri", default=None, help="default: sqlite:///outputs/mlflow.db")
    args = parser.parse_args(argv)
    client = MlflowClient(args.tracking_uri or default_tracking_uri("."))
    text, png, _ = compare(client, args.target, args.metric, Path(args.out))
    print(text)
    print(f"\nreward curves: {png}")


if __name__ == "__main__":
    main()
