"""Compare runs: a table sorted by a metric and a PNG overlaying their reward curves.

    python -m grpo_pipeline compare <sweep parent run id | experiment name> [--metric reward] [--out DIR]
        [--tracking-uri sqlite:///outputs/mlflow.db]

Given a sweep's parent run id, it compares that sweep's jobs; given an experiment name, all its runs.
A failed run shows the first line of its `error` tag. URL credentials are masked in the table and plot.

Runs that differ only in `seed` are one point: when a point has several finished seeds, a second table
gives per point the mean held-out score (`eval_after/mean_reward`; the sorting metric where a run has no
held-out score), a bootstrap 95% interval of that mean, and whether the point is distinguishable from the
best one (the Welch t 95% interval of the difference of means excludes 0; a point needs 2+ seeds for a
verdict). comparison_points.png draws them.
"""

import argparse
import math
import re
from pathlib import Path

import numpy as np

from grpo_pipeline.tracking.mlflow_run import default_tracking_uri
from grpo_pipeline.tracking.redact import mask_secrets

COLUMNS = ("run", "status", "final reward", "held-out after", "gain", "gain se", "kl", "wall s", "error")


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
            "gain": m.get("eval_after/gain"),
            "gain se": m.get("eval_after/gain_se"),
            "kl": m.get("kl"),
            "wall s": (end - r.info.start_time) / 1000 if end else None,
            "error": (r.data.tags.get("error") or "").strip().split("\n")[0] or None,
            "sort": m.get(metric),
            "point": _point(r),
            "score": m.get("eval_after/mean_reward", m.get(metric)),
        })
    return sorted(out, key=lambda x: (x["sort"] is None or x["status"] != "FINISHED",
                                      -(x["sort"] if x["sort"] is not None else -math.inf)))


def _point(run) -> str:
    """The sweep point a run belongs to: its overrides (or name) without the seed."""
    name = run.info.run_name or run.info.run_id[:8]
    label = re.sub(r"(^|,)seed=[^,]*", "", name).strip(",") or "(defaults)"
    overrides = run.data.tags.get("overrides")
    if overrides is None:
        return label
    return " ".join(sorted(o for o in overrides.split() if o.lstrip("+~").partition("=")[0] != "seed")) or label


def bootstrap_mean(values, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): scipy's percentile bootstrap interval of the mean of `values` (one value, or no spread:
    no interval, where scipy would give NaN)."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    if v.size < 2 or np.ptp(v) == 0:
        return mean, mean, mean
    ci = stats.bootstrap((v,), np.mean, n_resamples=n_boot, confidence_level=level, method="percentile",
                         rng=np.random.default_rng(seed)).confidence_interval
    return mean, float(ci.low), float(ci.high)


def welch_difference(a, b, level: float = 0.95) -> tuple[float, float]:
    """The Welch t interval of mean(a) - mean(b) (scipy's ttest_ind, unequal variances); both need 2+ values.
    Neither side with any spread: the difference itself (scipy would give NaN)."""
    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        diff = float(a.mean() - b.mean())
        return diff, diff
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(confidence_level=level)
    return float(ci.low), float(ci.high)


def points(items: list[dict]) -> list[dict]:
    """Finished runs grouped by point (seed dropped), best mean first; empty unless some point has 2+ seeds.
    Scored by the held-out score when every finished run has one, else by the sorting metric (never a mix)."""
    finished = [item for item in items if item["status"] == "FINISHED"]
    key = "score" if all(item["score"] is not None for item in finished) else "sort"
    groups: dict[str, list[float]] = {}
    for item in finished:
        if item[key] is not None:
            groups.setdefault(item["point"], []).append(item[key])
    if not any(len(v) > 1 for v in groups.values()):
        return []
    common = set.intersection(*(set(point.split()) for point in groups))  # shown once, not on every row
    out = []
    for point, scores in groups.items():
        mean, low, high = bootstrap_mean(scores)
        shown = " ".join(t for t in point.split() if t not in common) or point
        out.append({"point": shown, "seeds": len(scores), "mean": mean, "low": low, "high": high, "scores": scores})
    # the best point among those with 2+ seeds: a single lucky seed cannot be "best"
    out.sort(key=lambda p: (p["seeds"] < 2, -p["mean"]))
    best = out[0]
    best["vs best"] = "best"
    for p in out[1:]:
        if p["seeds"] < 2:
            p["vs best"] = "n/a (1 seed)"
            continue
        low, high = welch_difference(best["scores"], p["scores"])
        p["vs best"] = (f"worse (diff CI {low:+.3f}..{high:+.3f})" if low > 0 else
                        f"within seed noise (diff CI {low:+.3f}..{high:+.3f})")
    return out


def points_table(pts: list[dict]) -> str:
    head = ("point", "seeds", "mean", "95% CI", "vs best")
    cells = [[mask_secrets(p["point"]), str(p["seeds"]), f"{p['mean']:.3f}", f"{p['low']:.3f}..{p['high']:.3f}",
              p["vs best"]] for p in pts]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(head)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip(),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def plot_points(pts: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(pts)))
    ys = list(range(len(pts)))[::-1]
    for y, p in zip(ys, pts, strict=True):
        ax.errorbar(p["mean"], y, xerr=[[p["mean"] - p["low"]], [p["high"] - p["mean"]]], fmt="o", capsize=4,
                    color="tab:blue" if p["vs best"] == "best" or p["vs best"].startswith("within") else "tab:gray")
        ax.scatter(p["scores"], [y] * len(p["scores"]), s=10, color="black", alpha=0.5, zorder=3)
    ax.set_yticks(ys, [f"{mask_secrets(p['point'])[:60]} (n={p['seeds']})" for p in pts], fontsize=7)
    ax.set_xlabel("held-out mean reward after training: mean over seeds, bootstrap 95% interval, each seed")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(items: list[dict]) -> str:
    def fmt(v):
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[mask_secrets(fmt(item[c])) for c in COLUMNS] for item in items]
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
            ax.plot([m.step for m in history], [m.value for m in history], label=mask_secrets(item["run"])[:50])
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
    pts = points(items)
    if pts:
        text += ("\n\nPer point over seeds (held-out mean reward after training; bootstrap 95% interval of the mean;"
                 " 'worse' = the Welch 95% interval of the gap to the best point excludes 0):\n" + points_table(pts))
        plot_points(pts, out_dir / "comparison_points.png")
    (out_dir / "comparison.txt").write_text(text + "\n")
    if parent:
        for name in ("comparison.png", "comparison.txt", "comparison_points.png"):
            if (out_dir / name).exists() and (name != "comparison_points.png" or pts):
                client.log_artifact(parent, str(out_dir / name))
        for i, p in enumerate(pts):
            client.log_metric(parent, f"point{i}/mean", p["mean"])
            client.log_metric(parent, f"point{i}/ci_low", p["low"])
            client.log_metric(parent, f"point{i}/ci_high", p["high"])
            client.set_tag(parent, f"point{i}", mask_secrets(f"{p['point']} (n={p['seeds']}): {p['vs best']}")[:5000])
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
