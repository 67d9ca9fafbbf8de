"""Score a finished run's recorded completions again, with another reward or env config, without
generating (and without loading weights).

    python -m grpo_pipeline rescore <run dir> reward=length_penalty
    python -m grpo_pipeline rescore <run dir> reward=env env.format_weight=0.0 --split train

The run's config (its resolved_config.yaml) with the overrides applied by Hydra, in training's grammar (a group
choice like `reward=length_penalty` takes conf/reward/length_penalty.yaml in place of the run's section; a dotted
key sets one value the config has, `+key=value` adds one) builds the env and the reward components exactly as
training would sum them; every episode in the run's ledger (episodes.jsonl) is scored again and the old vs new mean
reward is printed per split and step. Training episodes get the total training would have given them; held-out ones
the env's score alone (as held-out evaluation scores). Episodes whose text the ledger cut (`ledger.max_chars`) are
left out, and components get the recorded (rendered) prompt and the completion's tokens re-encoded from its text.
An env whose `score_episode` calls the model cannot be re-scored without weights: those episodes are
counted as failed, with the reason.
"""

if __name__ == "__main__":  # before anything else is imported (tools/launch_path.py)
    from grpo_pipeline.tools.launch_path import drop_launch_dir

    drop_launch_dir()


import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.errors import ConfigError, PipelineError
from grpo_pipeline.tools.episodes import SPLIT_ORDER, by_step, load


class NoWeights:
    """Stands in for the policy: rescoring loads no weights, so any use of the model says why it fails."""

    training = False
    device = "cpu"

    def train(self, mode: bool = True):
        return self

    eval = train  # model.eval() and model.train() are what the runtime calls around episodes

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"rescore loads no weights, but the env used model.{name}: an env that calls the model "
                           "in score_episode cannot be re-scored from recorded completions.")

    def __call__(self, *args, **kwargs):
        return self.__getattr__("__call__")


def run_config(run_dir: Path, overrides: list[str]) -> DictConfig:
    """The run's resolved config with `overrides` applied by Hydra, with the grammar training takes: a group choice
    (reward=length_penalty) replaces that section with conf/'s option, key=value sets a key the config has,
    +key=value adds one, ~key deletes one. A bad override is a ConfigError naming it."""
    path = run_dir / "resolved_config.yaml"
    if not path.exists():
        raise SystemExit(f"ERROR: {path} not found: is {run_dir} a run dir of this pipeline?")
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as e:
        raise ConfigError(f"override {e.override!r}: {e}\n{_GRAMMAR}") from e
    groups = sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir())
    run = OmegaConf.load(path)
    for o in parsed:  # a group choice replaces the run's section (the run's keys do not linger in the new option)
        if o.key_or_group in groups and not o.is_delete() and isinstance(o.value(), str):
            run.pop(o.key_or_group, None)
    # the run's config is the primary config, then every group of conf/ unselected unless an override picks one;
    # untyped (no train_schema), so a run dir of an earlier schema still rescores
    primary = OmegaConf.merge({"defaults": ["_self_", *({group: None} for group in groups)]}, run)
    ConfigStore.instance().store(name=_PRIMARY, node=primary)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name=_PRIMARY, overrides=list(overrides))
    except Exception as e:  # Hydra's and OmegaConf's compose errors: keep their message, drop the traceback
        cause = f" ({e.__cause__})" if e.__cause__ and str(e.__cause__) not in str(e) else ""
        message = f"{e}{cause}".strip().replace(f"'{_PRIMARY}'", str(path))
        raise ConfigError(f"rescore {' '.join(overrides)}: {message}\n{_GRAMMAR}") from e
    finally:
        GlobalHydra.instance().clear()


_PRIMARY = "grpo_pipeline_rescore_run"  # the run's config as Hydra's primary config (ConfigStore; each call replaces it)
_GRAMMAR = ("Overrides are Hydra's, as for training: group=option (reward=length_penalty), key=value for a key the "
            "run's config has (env.format_weight=0.0), +key=value to add one, ~key to delete one.")


def rescore(run_dir: Path, overrides: list[str], split: str | None = None) -> tuple[list[dict], list[dict]]:
    """(entries, new scores): for each ledger entry {"reward": new total, "parts": {...}, "error": str|None}."""
    from grpo_pipeline.envs.loader import importable_from, load_env
    from grpo_pipeline.envs.runner import EpisodeRunner
    from grpo_pipeline.models import load_tokenizer
    from grpo_pipeline.tools.doctor import Scorer

    cfg = run_config(run_dir, overrides)
    entries = [e for e in load(str(run_dir)) if (split is None or e["split"] == split) and not e.get("truncated")]
    if not entries:
        raise SystemExit(f"ERROR: no recorded episodes in {run_dir} (split {split or 'any'}).")
    launch_dir = _announce_imports(run_dir, cfg)
    env = load_env(OmegaConf.to_container(cfg.env, resolve=True), launch_dir=launch_dir)
    tokenizer = load_tokenizer(cfg.model)
    rows = [e.get("row") or {} for e in entries]
    columns = sorted({k for row in rows for k in row})
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, columns)
    runner.bind(NoWeights())
    multi_turn = any(e.get("messages") for e in entries)
    with importable_from(launch_dir):  # reward components may live in the launch dir, like the env
        scorer = Scorer(cfg, runner, tokenizer, ["prompt", *columns], multi_turn)
    items = [e["messages"] if multi_turn else e["completion"] for e in entries]
    prompts = [e["prompt"] for e in entries]
    new = []
    for start in range(0, len(entries), 64):
        chunk = slice(start, start + 64)
        for total, parts, error in scorer.totals(prompts[chunk], items[chunk], rows[chunk]):
            new.append({"reward": total, "parts": parts, "error": error})
    for e, n in zip(entries, new, strict=True):
        if e["split"] != "train":  # held-out evaluation scores by the env alone: so does its re-scoring
            n["reward"] = n["parts"].get("env") if cfg.reward.env_weight > 0 else None
    return entries, new


def _announce_imports(run_dir: Path, cfg: DictConfig) -> str:
    """A run dir is code: its config names classes and functions that rescoring imports and runs. Say which, and
    from where (the launch dir the run recorded in run.json, else the working directory), before importing."""
    from grpo_pipeline.training.run_dir import read_record

    record = read_record(run_dir) or {}
    launch_dir = record.get("launch_dir") or str(Path.cwd())
    targets = [f"env._target_={cfg.env.get('_target_')}"]
    targets += [f"reward.components.{name}._target_={spec.get('_target_')}"
                for name, spec in (cfg.reward.components or {}).items()]
    print(f"rescore imports and runs the code {run_dir}'s config names: {', '.join(targets)} (modules looked up in "
          f"{launch_dir}, then the installed packages). Rescore only run dirs you trust.", file=sys.stderr)
    return launch_dir


def table(entries: list[dict], new: list[dict]) -> str:
    lines = [f"{'split':<12} {'step':>5} {'episodes':>8} {'old mean':>9} {'new mean':>9} {'changed':>8} {'failed':>7}"]
    for split, step, idx in by_step(entries):
        old = [entries[i]["reward"] for i in idx if entries[i].get("reward") is not None]
        now = [new[i]["reward"] for i in idx if new[i]["reward"] is not None]
        changed = sum(1 for i in idx if new[i]["reward"] is not None and entries[i].get("reward") is not None
                      and abs(new[i]["reward"] - entries[i]["reward"]) > 1e-6)
        lines.append(f"{split:<12} {step:>5} {len(idx):>8} {_mean(old):>9} {_mean(now):>9} {changed:>8} "
                     f"{sum(new[i]['error'] is not None for i in idx):>7}")
    return "\n".join(lines)


def _mean(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f}" if values else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run dir")
    parser.add_argument("overrides", nargs="*", help="reward=..., env.*=..., reward.components.*=...")
    parser.add_argument("--split", choices=sorted(SPLIT_ORDER))
    args = parser.parse_args(argv)
    try:
        entries, new = rescore(Path(args.run), args.overrides, args.split)
    except PipelineError as e:
        sys.exit(f"ERROR: {e}")
    print(f"re-scored {len(entries)} recorded episodes of {args.run} with {' '.join(args.overrides) or 'its own config'}"
          " (no generation, no weights):")
    print(table(entries, new))
    errors = [n["error"] for n in new if n["error"]]
    if errors:
        print(f"\n{len(errors)} episode(s) could not be scored; first: {errors[0].splitlines()[0]}", file=sys.stderr)


if __name__ == "__main__":
    main()
