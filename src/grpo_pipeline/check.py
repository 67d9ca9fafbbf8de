"""The env doctor: `python -m grpo_pipeline.check env=hotel [model=...] [check.num_prompts=8]`.

Validates and instantiates the env, builds its dataset, samples `generation.num_generations`
completions for `check.num_prompts` prompts with the configured model and sampling settings, scores
them through the same runtime as training, and prints a compact report with concrete warnings.
Exit code 0: the env works (warnings may remain); 1: episodes fail, time out or return invalid
scores; 2: the config or env cannot even be loaded.
"""

import statistics
import sys
import time
from dataclasses import dataclass, field

import hydra
from omegaconf import DictConfig

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.config.schema import register_configs
from grpo_pipeline.errors import PipelineError

register_configs()


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)

    def text(self) -> str:
        out = list(self.lines)
        out += [f"WARNING: {w}" for w in self.warnings] + [f"BROKEN: {b}" for b in self.broken]
        out.append("verdict: " + ("BROKEN" if self.broken else "OK with warnings" if self.warnings else "OK"))
        return "\n".join(out)


def run_check(cfg: DictConfig) -> Report:
    from grpo_pipeline.config.validate import check_config
    from grpo_pipeline.envs.loader import get_tool_schemas
    from grpo_pipeline.evaluation import generate
    from grpo_pipeline.models import load_model
    from grpo_pipeline.prompts import render_prompt
    from grpo_pipeline.recipe import load_env_and_dataset
    from grpo_pipeline.runtime.episodes import EpisodeRunner, score_problem
    from grpo_pipeline.runtime.rollout import make_rollout

    check_config(cfg)
    env, tokenizer, dataset, _ = load_env_and_dataset(cfg)
    name = type(env).__qualname__
    tools = get_tool_schemas(env)
    extra = [c for c in dataset.column_names if c != "prompt"]
    r = Report()
    r.lines += [
        f"env: {name} ({cfg.env.get('_target_')})",
        f"dataset: {len(dataset)} rows, columns {dataset.column_names}, tools {[t.get('function', t)['name'] for t in tools]}",
        "sample prompt (as the model sees it):",
        _indent(render_prompt(tokenizer, dataset[0]["prompt"])[0][-600:]),
    ]
    rows = dataset.shuffle(seed=cfg.seed).select(range(min(cfg.check.num_prompts, len(dataset))))
    group = cfg.generation.num_generations
    prompts = [p for p in rows["prompt"] for _ in range(group)]
    model = load_model(cfg.model, tokenizer)
    gen = cfg.generation
    sampling = {"do_sample": True, "temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p}
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, extra, sampling=sampling)
    runner.bind(model)
    row_dicts = [{k: rows[i][k] for k in extra} for i in range(len(rows)) for _ in range(group)]
    rollout = make_rollout(cfg, env, tokenizer, runner, [])
    rollout = rollout if rollout is not None and rollout.multi_turn else None  # single turns: as TRL samples
    started = time.monotonic()
    failures = [None] * len(prompts)
    if rollout is None:
        completions = generate(model, tokenizer, prompts, gen.max_new_tokens, cfg.eval.batch_size, sampling)
        episodes_in = completions
    else:  # the runtime plays whole episodes: show one turn by turn
        trajs = [t for start in range(0, len(prompts), cfg.eval.batch_size)
                 for t in rollout.run(model, prompts[start : start + cfg.eval.batch_size],
                                      row_dicts[start : start + cfg.eval.batch_size], sampling)]
        episodes_in, completions = [t.messages for t in trajs], [t.text for t in trajs]
        failures = [t.failure for t in trajs]
        r.lines += ["sample episode (turn by turn, after the opening):"] + [
            _indent(f"[{m['role']}] {m['content'][:300]}") for m in trajs[0].messages]
        r.lines.append(f"turns per episode: mean {statistics.fmean(t.turns for t in trajs):.2f} (max_turns "
                       f"{rollout.max_turns}); env tokens: mean {statistics.fmean(t.env_tokens for t in trajs):.0f}; "
                       f"cut by runtime.max_episode_tokens: {sum(t.cut for t in trajs)}")
        r.broken += [f"{f.splitlines()[0]}" for f in failures if f]
    r.lines.append(f"generated {len(completions)} {'episodes' if rollout else 'completions'} ({len(rows)} prompts x {group}) "
                   f"in {time.monotonic() - started:.1f}s")
    episodes = runner.run_episodes(episodes_in, row_dicts, skip=[f is not None for f in failures])
    scores = []
    for ep, completion, failure in zip(episodes, completions, failures, strict=True):
        if failure:
            continue
        if ep.timed_out:
            r.broken.append(f"episode timed out after {cfg.runtime.episode_timeout_s:g}s; completion {completion[:80]!r}")
        elif ep.error is not None:
            r.broken.append(f"score_episode raised {ep.error.__class__.__name__}: {ep.error}; completion {completion[:80]!r}")
        elif score_problem(ep.value):
            r.broken.append(f"score_episode {score_problem(ep.value)} completion {completion[:80]!r}")
        else:
            scores.append(float(ep.value))
    _score_report(r, scores, episodes, group, completions, cfg.check.slow_episode_s)
    return r


def _score_report(r: Report, scores, episodes, group: int, completions, slow_s: float) -> None:
    if scores:
        r.lines.append(
            f"scores: n={len(scores)} mean={statistics.fmean(scores):.3f} std={statistics.pstdev(scores):.3f} "
            f"min={min(scores):.3f} max={max(scores):.3f} exact 0: {sum(s == 0 for s in scores) / len(scores):.0%} "
            f"exact 1: {sum(s == 1 for s in scores) / len(scores):.0%}"
        )
        if all(s == 0 for s in scores):
            r.warnings.append("all scores are 0: the model never gets credit and GRPO cannot learn; add partial "
                              "credit (e.g. for the answer format) or a worked example in the prompt.")
        elif all(s == 1 for s in scores):
            r.warnings.append("all scores are 1: the task is already solved; make it harder.")
    if len(scores) == len(episodes):  # group spread is only meaningful when every episode scored
        groups = [scores[i : i + group] for i in range(0, len(scores), group)]
        flat = sum(1 for g in groups if max(g) == min(g))
        r.lines.append(f"groups: {len(groups)}, with no reward spread (all scores equal): {flat}")
        if flat > len(groups) / 2:
            r.warnings.append(f"{flat}/{len(groups)} groups have equal scores: GRPO learns nothing from them; "
                              "grade more finely or raise generation.temperature / num_generations.")
    slowest = sorted(range(len(episodes)), key=lambda i: -episodes[i].seconds)[:3]
    r.lines.append("slowest episodes: " + ", ".join(f"{episodes[i].seconds:.2f}s ({completions[i][:30]!r})"
                                                    for i in slowest))
    mean_s = statistics.fmean(ep.seconds for ep in episodes)
    if mean_s > slow_s:
        r.warnings.append(f"episodes take {mean_s:.1f}s on average (> check.slow_episode_s={slow_s:g}): raise "
                          "runtime.max_concurrency if the env waits on I/O.")
    failures = sum(1 for ep in episodes if ep.error is not None or ep.timed_out)
    r.lines.append(f"failures: {failures}, timeouts: {sum(ep.timed_out for ep in episodes)}")


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        report = run_check(cfg)
    except PipelineError as e:
        print(f"\nERROR: {e}\nverdict: BROKEN", file=sys.stderr)
        sys.exit(2)
    print(report.text())
    sys.exit(1 if report.broken else 0)


if __name__ == "__main__":
    _hydra_main()
