"""The reward-curve PNG written into the run dir and logged to MLflow."""

from pathlib import Path


def plot_rewards(rewards: list[float], path: Path, eval_before: dict | None = None, eval_after: dict | None = None,
                 validation: list | None = None, model_step: int | None = None):
    """Train mean reward per logging step (+ moving average), the validation curve with the step whose weights
    model/ holds, and the held-out test score before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rewards = [float("nan") if r is None else r for r in rewards]  # a step whose episodes all failed: no reward
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(rewards) + 1)
    ax.plot(steps, rewards, marker=".", alpha=0.5, label="train mean reward (per logging step)")
    window = max(1, len(rewards) // 8)
    if window > 1:
        smooth = [np.nanmean(w) if not np.isnan(w := rewards[max(0, i - window + 1): i + 1]).all() else np.nan
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"moving average ({window})")
    if validation:
        ax.plot([s for s, _ in validation], [v for _, v in validation], marker="o", color="tab:green",
                label="validation mean reward")
        kept = [v for s, v in validation if s == model_step]
        if kept:
            ax.scatter([model_step], kept, s=120, facecolors="none", edgecolors="tab:green", linewidths=2, zorder=4,
                       label=f"model/: step {model_step}")
    for ev, name, x in ((eval_before, "test before", 0), (eval_after, "test after (model/)", len(rewards))):
        if ev:
            ax.scatter([x], [ev["mean_reward"]], s=80, marker="*", zorder=3, label=f"{name}: {ev['mean_reward']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
