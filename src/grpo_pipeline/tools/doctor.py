"""The env doctor: `python -m grpo_pipeline check env=hotel [model=...] [check.num_prompts=8]`.

Validates and instantiates the env, builds its dataset, samples max(`check.num_generations`) completions
for `check.num_prompts` prompts with the configured model and sampling settings, scores them through the
same runtime as training, and prints a compact report with concrete warnings:
- learnability: for each group size in `check.num_generations`, the expected share of groups with no
  reward spread (GRPO learns nothing from them) and the mean within-group std, and which
  `generation.num_generations` to use; it says plainly when the env gives no signal at all;
- what training can reach: pass@k (the share of prompts solved at least once in k samples) and the
  expected best-of-k reward, for k up to max(`check.num_generations`);
- reward-exploit probes (`check.probes`): degenerate completions (empty, whitespace, the prompt echoed, the
  answer tag with a random value, a long repetition, the first half of a good completion, a worked example's last reply copied) scored through
  the env and every reward component; a warning when one earns more than the base model's mean, and when
  the same completions scored a second time get different scores (a nondeterministic reward).
Exit code 0: the env works (warnings may remain); 1: episodes fail, time out or return invalid
scores; 2: the config or env cannot even be loaded.
"""

if __name__ == "__main__":  # before anything else is imported (tools/launch_path.py)
    from grpo_pipeline.tools.launch_path import drop_launch_dir

    drop_launch_dir()


import math
import random
import re
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
    from transformers import set_seed

    from grpo_pipeline.config.plan import make_plan
    from grpo_pipeline.config.validate import check_config
    from grpo_pipeline.envs.loader import env_name, get_tool_schemas
    from grpo_pipeline.envs.recorder import CallRecorder
    from grpo_pipeline.envs.runner import EpisodeRunner, score_problem
    from grpo_pipeline.evaluation.heldout import Split, generate
    from grpo_pipeline.models import load_model, model_dir
    from grpo_pipeline.prompts import render_prompt
    from grpo_pipeline.recipe import load_env_and_dataset, sampling
    from grpo_pipeline.rollout.turns import make_rollout

    check_config(cfg)
    env, tokenizer, dataset, _ = load_env_and_dataset(cfg)
    name = env_name(env)
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
    sizes = sorted({int(n) for n in cfg.check.num_generations if int(n) >= 2})
    if not sizes:
        raise PipelineError(f"check.num_generations={list(cfg.check.num_generations)}: list group sizes >= 2, "
                            "e.g. check.num_generations=[2,4,8].")
    group = max(sizes)
    prompts = [p for p in rows["prompt"] for _ in range(group)]
    model = load_model(cfg.model, tokenizer)
    gen = cfg.generation
    sample = sampling(gen)
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, extra, sampling=sample, seed=cfg.seed)
    runner.bind(model)
    row_dicts = [{k: rows[i][k] for k in extra} for i in range(len(rows)) for _ in range(group)]
    plan = make_plan(cfg, env, tokenizer, Split(dataset, None, None), [], name)
    # single turns: as TRL
    rollout = make_rollout(plan, env, tokenizer, runner, lambda: model_dir(cfg.model)) if plan.multi_turn else None
    set_seed(cfg.seed)  # the same config samples the same completions: a report can be reproduced
    started = time.monotonic()
    failures = [None] * len(prompts)
    if rollout is None:
        completions = generate(model, tokenizer, prompts, gen.max_new_tokens, cfg.eval.batch_size, sample)
        episodes_in = completions
    else:  # the runtime plays whole episodes: show one turn by turn
        trajs = [t for start in range(0, len(prompts), cfg.eval.batch_size)
                 for t in rollout.run(model, prompts[start : start + cfg.eval.batch_size],
                                      row_dicts[start : start + cfg.eval.batch_size], sample)]
        episodes_in, completions = [t.messages for t in trajs], [t.text for t in trajs]
        failures = [t.failure for t in trajs]
        if rollout.stateful:  # its session extended the opening (a TRL env's reset() text)
            r.lines += ["the first episode's opening, as its session extended it:",
                        _indent(render_prompt(tokenizer, trajs[0].prompt)[0][-400:])]
        r.lines += ["sample episode (turn by turn, after the opening):"] + [
            _indent(f"[{m['role']}] {m['content'][:300]}") for m in trajs[0].messages]
        r.lines.append(f"turns per episode: mean {statistics.fmean(t.turns for t in trajs):.2f} (max_turns "
                       f"{rollout.max_turns}); env tokens: mean {statistics.fmean(t.env_tokens for t in trajs):.0f}; "
                       f"cut by runtime.max_episode_tokens: {sum(t.cut for t in trajs)}")
        r.broken += [f"{f.splitlines()[0]}" for f in failures if f]
    r.lines.append(f"generated {len(completions)} {'episodes' if rollout else 'completions'} ({len(rows)} prompts x {group}) "
                   f"in {time.monotonic() - started:.1f}s")
    recorders = [CallRecorder(sample) for _ in row_dicts]  # the env's own generate calls, as training records them
    episodes = runner.run_episodes(episodes_in, row_dicts, skip=[f is not None for f in failures], recorders=recorders)
    style = getattr(env, "env_style", None)  # an env wrapper that describes itself (envs/trl_env.py)
    r.lines.append(style() if callable(style) else _style(rollout is not None, recorders, cfg.runtime.train_env_calls))
    scores, values = [], []
    for ep, completion, failure in zip(episodes, completions, failures, strict=True):
        values.append(None)
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
            values[-1] = float(ep.value)
    _score_report(r, scores, episodes, completions, cfg.check.slow_episode_s)
    groups = [values[i : i + group] for i in range(0, len(values), group)]
    _learnability(r, groups, sizes, cfg.generation.num_generations)
    if cfg.check.probes and scores:
        prober = Prober(cfg, runner, tokenizer, dataset.column_names, rollout is not None)
        prober.nondeterminism(r, episodes_in, row_dicts, values)
        prober.exploits(r, list(rows["prompt"]), row_dicts[::group], groups, completions, episodes_in, values, group)
    return r


def _style(multi_turn: bool, recorders: list, train_env_calls: bool) -> str:
    """Which style the env is written in, and what training trains of its episodes."""
    if multi_turn:
        return ("env style: respond (the runtime generates every assistant turn): every assistant turn is trained, "
                "the env's turns are masked out of the loss")
    turns = [len(rec.samples) for rec in recorders]
    skipped = sum(rec.skipped for rec in recorders)
    if not any(turns) and not skipped:
        return "env style: single-turn (score_episode makes no model call): the completion is trained"
    what = ("each trained as a row of its own with the episode's advantage" if train_env_calls else
            "not trained: runtime.train_env_calls=false trains the first reply alone")
    return (f"env style: seed (score_episode calls model.generate itself): {statistics.fmean(turns):.1f} sampled "
            f"turns per episode, {what}; {skipped} call(s) sampled otherwise than the run (greedy, their own "
            "temperature or logits processors) are never trained")


def flat_share(scores: list[float], size: int) -> float:
    """The chance that `size` completions drawn (without replacement) from this group all score the same:
    an unbiased estimate of the flat-group probability at group size `size` <= len(scores)."""
    counts: dict[float, int] = {}
    for s in scores:
        counts[s] = counts.get(s, 0) + 1
    return sum(math.comb(c, size) for c in counts.values()) / math.comb(len(scores), size)


PASS_KS = (1, 2, 4, 8, 16, 32, 64, 128)  # the k of pass@k and best-of-k reported (up to the samples drawn)


def pass_at_k(scores: list[float], k: int, full: float = 1.0) -> float:
    """The chance that at least one of `k` completions drawn (without replacement) from this group earns a
    full score (>= `full`): the unbiased pass@k estimator of Chen et al. 2021 (arXiv:2107.03374)."""
    n, wrong = len(scores), sum(s < full for s in scores)
    return 1.0 if wrong < k else 1.0 - math.comb(wrong, k) / math.comb(n, k)


def best_of_k(scores: list[float], k: int) -> float:
    """The expected best score of `k` completions drawn (without replacement) from this group: the i-th
    smallest of n is the best of k with chance C(i-1, k-1) / C(n, k)."""
    ranked = sorted(scores)
    return sum(s * math.comb(i, k - 1) for i, s in enumerate(ranked)) / math.comb(len(ranked), k)


def _learnability(r: Report, groups: list[list], sizes: list[int], training_size: int) -> None:
    """Per group size: the expected share of flat groups and the mean within-group std; a recommendation."""
    complete = [g for g in groups if None not in g]  # a failed episode has no score: its group is left out
    if not complete:
        return
    r.lines.append(f"learnability over {len(complete)} prompts x {len(complete[0])} samples "
                   "(groups with no reward spread give GRPO nothing):")
    flat = {}
    for n in sizes:
        flat[n] = statistics.fmean(flat_share(g, n) for g in complete)
        r.lines.append(f"    num_generations={n}: flat groups {flat[n]:.0%}")
    r.lines.append(f"    mean within-group std: {statistics.fmean(statistics.pstdev(g) for g in complete):.3f}")
    _reach(r, complete)
    if all(max(g) == min(g) for g in complete) and len({g[0] for g in complete}) == 1:
        r.warnings.append(f"the env gives no signal: every sampled completion scored {complete[0][0]:g}, so every "
                          "group is flat at any group size. Add partial credit or a worked example, or make the "
                          "task easier, before training.")
        return
    good = [n for n in sizes if flat[n] <= 0.5]
    pick = good[0] if good else sizes[-1]
    r.lines.append(f"    recommendation: generation.num_generations={pick} (the smallest size listed with at most half "
                   f"the groups flat; training uses {training_size})")
    if not good:
        r.warnings.append(f"even at num_generations={sizes[-1]}, {flat[sizes[-1]]:.0%} of groups are flat: most steps "
                          "teach nothing. Grade more finely, raise generation.temperature, or ease the task.")
    elif training_size in flat and flat[training_size] > 0.5:
        r.warnings.append(f"at the configured generation.num_generations={training_size}, {flat[training_size]:.0%} of "
                          f"groups are flat: use {pick} or grade more finely.")


def _reach(r: Report, complete: list[list]) -> None:
    """What training can be expected to reach: GRPO mostly sharpens what the model already samples, so the
    share of prompts solved at least once in k samples (pass@k) roughly predicts what a run makes the greedy answer
    (measured: near pass@16-32 on env=arithmetic, docs/envs.md, the env doctor)."""
    ks = [k for k in PASS_KS if k <= len(complete[0])]
    passes = {k: statistics.fmean(pass_at_k(g, k) for g in complete) for k in ks}
    best = {k: statistics.fmean(best_of_k(g, k) for g in complete) for k in ks}
    r.lines.append("what training can reach (GRPO mostly sharpens what the model already samples; on env=arithmetic "
                   "trained runs' greedy success landed near the base model's pass@16-32):")
    r.lines.append("    " + ", ".join(f"pass@{k} {passes[k]:.2f}" for k in ks) + " (a full score, 1.0)")
    r.lines.append("    " + ", ".join(f"best of {k} {best[k]:.3f}" for k in ks) + " (mean reward)")
    k = ks[-1]
    if passes[k] == 0.0:
        r.warnings.append(f"no sampled completion earned a full score (pass@{k} 0.00): training can only climb on "
                          "partial credit until it samples one (easy hotel took 16 steps). Ease the task, add a "
                          "worked example, or give partial credit that points to a full score.")


class Scorer:
    """Scores arbitrary completions exactly as training does: the env (through the runtime) times
    reward.env_weight plus every reward component times its weight. (The doctor's probes; tools/rescore.py.)"""

    def __init__(self, cfg: DictConfig, runner, tokenizer, columns: list[str], multi_turn: bool):
        from grpo_pipeline.rewards.assemble import build_rewards

        funcs, weights = build_rewards(cfg.reward, lambda **_: None, columns)
        env_on = cfg.reward.env_weight > 0
        self.env_weight = float(cfg.reward.env_weight)
        self.components = list(zip(funcs[1:] if env_on else funcs, weights[1:] if env_on else weights, strict=True))
        self.cfg, self.runner, self.tokenizer, self.multi_turn = cfg, runner, tokenizer, multi_turn

    def totals(self, prompts: list, items: list, rows: list[dict],
               env_values: list | None = None) -> list[tuple[float | None, dict, str | None]]:
        """(total reward, per-part scores, error) for each item (a completion, or a transcript if multi-turn);
        `env_values`: env scores already known (None for a failed episode), else the env scores the items."""
        if env_values is None and self.env_weight == 0:
            env_values, errors = [0.0] * len(items), [None] * len(items)
        elif env_values is None:
            from grpo_pipeline.envs.runner import score_problem

            episodes = self.runner.run_episodes(items, rows)
            errors = ["timed out" if ep.timed_out else f"{ep.error.__class__.__name__}: {ep.error}"
                      if ep.error is not None else f"score_episode {score_problem(ep.value)}"
                      if score_problem(ep.value) else None for ep in episodes]
            env_values = [None if error else float(ep.value) for ep, error in zip(episodes, errors, strict=True)]
        else:
            errors = [None if v is not None else "failed" for v in env_values]
        from grpo_pipeline.envs.runner import completion_text

        texts = [completion_text(x) for x in items]  # a transcript's assistant turns, as the rollout joins them
        parts = [{"env": v} for v in env_values]
        columns = {k: [row.get(k) for row in rows] for k in {k for row in rows for k in row}}
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] if self.components else []
        for fn, _w in self.components:
            for part, value in zip(parts, fn(prompts=prompts, completions=texts, completion_ids=ids, **columns),
                                   strict=True):
                part[fn.__name__] = None if value is None else float(value)  # None: not scored by it (as in TRL)
        out = []
        for part, error in zip(parts, errors, strict=True):
            if part["env"] is None:
                out.append((None, part, error))
                continue
            total = self.env_weight * float(part["env"]) + sum(
                w * part[fn.__name__] for fn, w in self.components if part[fn.__name__] is not None)
            out.append((total, part, None))
        return out


class Prober(Scorer):
    """The doctor's reward-exploit and nondeterminism probes."""

    def __init__(self, cfg: DictConfig, runner, tokenizer, columns: list[str], multi_turn: bool):
        super().__init__(cfg, runner, tokenizer, columns, multi_turn)
        self.rng = random.Random(cfg.seed)

    def nondeterminism(self, r: Report, items: list, rows: list[dict], values: list) -> None:
        """Score the first few scored completions again: a reward must give the same completion the same score."""
        again = [i for i, v in enumerate(values) if v is not None][:8]
        episodes = self.runner.run_episodes([items[i] for i in again], [rows[i] for i in again])
        from grpo_pipeline.envs.runner import completion_text

        differ = [(i, values[i], ep.value) for i, ep in zip(again, episodes, strict=True)
                  if ep.error is None and not ep.timed_out and ep.value != values[i]]
        r.lines.append(f"scored {len(again)} completions a second time: {len(differ)} got a different score")
        if differ:
            i, first, second = differ[0]
            r.warnings.append(f"nondeterministic reward: the same completion scored {first:g}, then {second:g} "
                              f"({len(differ)}/{len(again)} differ; e.g. {completion_text(items[i])[:60]!r}). GRPO then "
                              "learns from noise: seed the env's randomness per row, or score greedily.")

    def exploits(self, r: Report, prompts: list, rows: list[dict], groups: list[list], completions: list[str],
                 items: list, values: list, group: int) -> None:
        """Degenerate completions for every checked prompt, scored like training; warn when one earns more than
        the base model's completions of the same prompts do on average."""
        base = self.totals([p for p in prompts for _ in range(group)], items, [x for x in rows for _ in range(group)],
                           env_values=values)
        base_totals = [t for t, _, _ in base if t is not None]
        if not base_totals:
            return
        base_mean = statistics.fmean(base_totals)
        probes: dict[str, list] = {}
        for k, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
            scored = [(v, completions[k * group + j]) for j, v in enumerate(groups[k]) if v is not None]
            good = max(scored, key=lambda x: x[0])[1] if scored else completions[k * group]
            for name, text in self._probes(prompt, good).items():
                probes.setdefault(name, []).append((prompt, text, row))
        r.lines.append(f"reward-exploit probes (base model mean reward {base_mean:.3f}):")
        for name, cases in probes.items():
            items_in = [_as_episode(t) if self.multi_turn else t for p, t, _ in cases]
            results = self.totals([p for p, _, _ in cases], items_in, [row for _, _, row in cases])
            totals = [t for t, _, _ in results if t is not None]
            errors = [e for _, _, e in results if e]
            parts = " ".join(f"{k}={statistics.fmean(x[1][k] for x in results if x[1][k] is not None):.2f}"
                             for k in results[0][1] if any(x[1][k] is not None for x in results))
            mean = statistics.fmean(totals) if totals else None
            r.lines.append(f"    {name:<22} {'-' if mean is None else f'{mean:.3f}'}  ({parts}; e.g. "
                           f"{cases[0][1][:40]!r})")
            if errors:
                r.warnings.append(f"probe '{name}': score_episode failed ({errors[0].splitlines()[0]}): an env "
                                  "should score any text the model may write, not raise.")
            if mean is not None and mean > base_mean + 1e-9:
                r.warnings.append(f"possible reward exploit: '{name}' completions (e.g. {cases[0][1][:40]!r}) earn "
                                  f"{mean:.3f}, more than the base model's mean {base_mean:.3f}. GRPO will find it: "
                                  "make the reward require the real answer.")
        if self.multi_turn and callable(getattr(self.runner.env, "score_turn", None)):
            self.turn_exploits(r, prompts, rows, items, group, probes)

    def turn_exploits(self, r: Report, prompts: list, rows: list[dict], items: list, group: int,
                      probes: dict[str, list]) -> None:
        """The same probes as first turns, scored by the env's score_turn (runtime.turn_credit=turn): warn when one
        earns more than the base model's first turns do. (env=hotel's score_turn once paid the worked example's
        booking copied, a room only the opening's example had listed: every run with turn credit collapsed onto it.)"""
        from grpo_pipeline.rollout.turns import conversation

        def turn_scores(cases: list[tuple]) -> list[float]:
            out = []
            for prompt, text, row in cases:
                turn = conversation(prompt, [{"role": "assistant", "content": text}])  # as the runtime calls it
                try:
                    out.append(float(self.runner.env.score_turn(turn, **row,
                                                                **self.runner.seed_kwargs("score_turn", None))))
                except Exception as e:  # noqa: BLE001 (an env's own code: reported, never fatal to the report)
                    r.warnings.append(f"score_turn raised {e.__class__.__name__}: {e} on {text[:40]!r}: an env "
                                      "should score any turn the model may write, not raise.")
                    return []
            return out

        firsts = [next((m["content"] for m in x if m.get("role") == "assistant"), "") if isinstance(x, list) else x
                  for x in items]
        base = turn_scores([(prompts[i // group], firsts[i], rows[i // group]) for i in range(len(firsts))])
        if not base:
            return
        base_mean = statistics.fmean(base)
        r.lines.append(f"turn-credit probes (score_turn of a first turn; base model's first turns {base_mean:.3f}):")
        for name, cases in probes.items():
            scores = turn_scores(cases)
            if not scores:
                return
            mean = statistics.fmean(scores)
            r.lines.append(f"    {name:<22} {mean:.3f}")
            if mean > base_mean + 1e-9:
                r.warnings.append(f"possible turn-credit exploit: score_turn pays a '{name}' first turn (e.g. "
                                  f"{cases[0][1][:40]!r}) {mean:.3f}, more than the base model's first turns "
                                  f"{base_mean:.3f}. runtime.turn_credit=turn will find it: score only what this "
                                  "episode did (the messages after its opening).")

    def _probes(self, prompt, good: str) -> dict[str, str]:
        tags = re.findall(r"<(\w+)>(.*?)</\1>", good, re.DOTALL)
        tag, inner = tags[-1] if tags else ("answer", "0")
        value = inner.strip()
        while value == inner.strip():  # a random value, never the good completion's own (often the right answer)
            value = (str(self.rng.randint(0, 10 ** max(2, len(inner.strip())) - 1)) if inner.strip().lstrip("-").isdigit()
                     else "".join(self.rng.choice("abcdefghij") for _ in range(max(3, len(inner.strip())))))
        ids = self.tokenizer(good, add_special_tokens=False)["input_ids"]
        phrase = " ".join(_user_text(prompt).split()[:6]) or "the answer"  # a model looping on the question
        limit = self.cfg.generation.max_new_tokens
        repeated = phrase
        for _ in range(limit):  # up to the completion length limit, as a looping model would write it
            if len(self.tokenizer(repeated, add_special_tokens=False)["input_ids"]) >= limit:
                break
            repeated += " " + phrase
        probes = {
            "empty": "",
            "whitespace": " \n\t ",
            "prompt echoed": _user_text(prompt),
            "tag, random value": f"<{tag}>{value}</{tag}>",
            "long repetition": repeated,
            "half a good answer": self.tokenizer.decode(ids[: len(ids) // 2], skip_special_tokens=True),
        }
        # a worked example in the prompt (few-shot assistant turns): its last reply copied, whatever was asked. A
        # hotel run collapsed into booking the example's room for every guest, which the reward then paid for
        examples = [] if isinstance(prompt, str) else [m["content"] for m in prompt if m.get("role") == "assistant"]
        if examples:
            probes["worked example copied"] = str(examples[-1])
        return probes


def _user_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else str(prompt[-1].get("content", ""))


def _as_episode(text: str) -> list[dict]:
    """A multi-turn env's `completion` (the episode after the opening): the probe as the assistant's only turn."""
    return [{"role": "assistant", "content": text}]


def _score_report(r: Report, scores, episodes, completions, slow_s: float) -> None:
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


def main() -> None:
    """`python -m grpo_pipeline check [overrides]`: Hydra reads the overrides from sys.argv."""
    _hydra_main()


if __name__ == "__main__":
    main()
