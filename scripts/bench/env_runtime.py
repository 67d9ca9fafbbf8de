"""The env runtime, measured side by side in one run on the tiny model (2-core CPU figures in docs/results.md).

(a) I/O-bound env, 50 ms wait per episode, 16 episodes: concurrent vs one-after-another scoring (goal >= 8x)
(b) multi-turn env, 3 model turns per episode, 8 episodes: batched vs per-episode generate (goal >= 3x)
(c) a whole training step: the pipeline vs a plain GRPOTrainer script with a plain reward function, same
    GRPOConfig (pipeline overhead, goal <= 1.05x)

    .venv/bin/python scripts/bench/env_runtime.py [--repeats 3] [--steps 30]
"""

import argparse
import os
import statistics
import tempfile
import time

import harness
import torch
from transformers import TrainerCallback

from grpo_pipeline.config.schema import ModelConfig, RuntimeConfig
from grpo_pipeline.envs.runner import EpisodeRunner
from grpo_pipeline.models import build_tiny_tokenizer, load_model
from grpo_pipeline.recipe import train


class SleepyEnv:
    def score_episode(self, model, tokenizer, completion, **_):
        time.sleep(0.05)  # a tool call, an API, a sandbox
        return 1.0


class MultiTurnEnv:
    def score_episode(self, model, tokenizer, completion, **_):
        text = completion
        for _ in range(3):
            enc = tokenizer(text, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=16, do_sample=True, pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(out[0, -24:], skip_special_tokens=True)
        return 1.0


def time_scoring(env, model, tok, n: int, repeats: int, **runtime) -> float:
    runner = EpisodeRunner(env, tok, RuntimeConfig(**runtime), [])
    runner.bind(model)
    return harness.median(lambda _: runner.score([f"What is {i} + {i}?" for i in range(n)], [{}] * n), repeats,
                          warmup=0)


class StepTimer(TrainerCallback):
    """Wall time between consecutive steps: generation, scoring, backward, optimizer and logging."""

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def median_step(self, skip: int = 3) -> float:
        gaps = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        return statistics.median(gaps[skip:])


def bench_step_overhead(steps: int, repeats: int, trl_generates: bool = False) -> tuple[float, float]:
    """Median step time of the pipeline and of a plain TRL script, interleaved, best of `repeats`.
    `trl_generates`: the pipeline lets TRL generate (no runtime rollout), isolating tracking/runtime overhead."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from peft import LoraConfig
    from trl import GRPOTrainer

    import grpo_pipeline.recipe as recipe
    from grpo_pipeline.config import CONFIG_DIR
    from grpo_pipeline.config.grpo_args import build_grpo_config
    from grpo_pipeline.config.schema import register_configs
    from grpo_pipeline.envs.arithmetic import ArithmeticEnv
    from grpo_pipeline.envs.runner import completion_text

    register_configs()
    tmp = tempfile.mkdtemp()
    overrides = ["model=tiny", "env=arithmetic", "eval.enabled=false", f"training.max_steps={steps}",
                 "training.save_model=false", f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db"]
    build = recipe._build_trainer
    pipeline, plain = [], []
    for r in range(repeats):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, f"output_dir={tmp}/p{r}"])
        timer = StepTimer()
        recipe._build_trainer = lambda *a, timer=timer: _with(build(*a), timer)
        make_rollout = recipe.make_rollout
        if trl_generates:
            recipe.make_rollout = lambda *a, **k: None
        try:
            train(cfg, launch_dir=tmp)
        finally:
            recipe._build_trainer, recipe.make_rollout = build, make_rollout
        pipeline.append(timer.median_step())

        # The same run as a plain TRL script: same model, data, GRPOConfig and score, no pipeline.
        tok = build_tiny_tokenizer()
        tok.padding_side = "left"
        env = ArithmeticEnv(**{k: v for k, v in cfg.env.items() if k != "_target_"})

        def reward(completions, answer, env=env, tok=tok, **_):
            return [env.score_episode(None, tok, completion_text(c), a) for c, a in zip(completions, answer, strict=True)]

        timer = StepTimer()
        trainer = GRPOTrainer(
            model=load_model(cfg.model, tok), reward_funcs=[reward], train_dataset=env.build_dataset(tok),
            args=build_grpo_config(_as_planned(cfg), f"{tmp}/plain{r}", [1.0]), processing_class=tok, callbacks=[timer],
            peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        )
        trainer.train()
        plain.append(timer.median_step())
    return min(pipeline), min(plain)


def _as_planned(cfg):
    """cfg with the recipe's choices the plan makes for nulls (the run's length and rate), as a run applies them."""
    import copy

    from omegaconf import OmegaConf

    from grpo_pipeline.config.plan import recipe_choices

    out = copy.deepcopy(cfg)
    for key, value in recipe_choices(cfg)[0].items():
        OmegaConf.update(out, key, value)
    return out


def _with(trainer, callback):
    trainer.add_callback(callback)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    harness.threads(args.threads)
    torch.manual_seed(0)
    tok = build_tiny_tokenizer()
    tok.padding_side = "left"
    model = load_model(ModelConfig(name="tiny", source="tiny"), tok).eval()
    harness.machine("tiny model")
    table = harness.Table(f"{'part: the baseline vs the runtime':<92}", "baseline", "runtime", "ratio", "goal")

    seq = time_scoring(SleepyEnv(), model, tok, 16, args.repeats, max_concurrency=1)
    con = time_scoring(SleepyEnv(), model, tok, 16, args.repeats, max_concurrency=16)
    table.row("(a) I/O-bound, 16 x 50 ms: sequential vs concurrent", f"{seq:.3f}s", f"{con:.3f}s",
              harness.ratio(seq, con), ">= 8x")

    per_episode = time_scoring(MultiTurnEnv(), model, tok, 8, args.repeats, max_concurrency=1)
    threads = time_scoring(MultiTurnEnv(), model, tok, 8, args.repeats, max_concurrency=8, batch_generate=False)
    batched = time_scoring(MultiTurnEnv(), model, tok, 8, args.repeats, max_concurrency=8, batch_generate=True)
    table.row("(b) multi-turn, 8 x 3 turns: per-episode vs threads without batching", f"{per_episode:.3f}s",
              f"{threads:.3f}s", harness.ratio(per_episode, threads), "")
    table.row("(b) multi-turn, 8 x 3 turns: per-episode vs batched", f"{per_episode:.3f}s", f"{batched:.3f}s",
              harness.ratio(per_episode, batched), ">= 3x")

    pipe, plain = bench_step_overhead(args.steps, args.repeats)
    table.row("(c) training step: plain GRPOTrainer vs the pipeline (ratio: pipeline / plain)", harness.ms(plain),
              harness.ms(pipe), f"{pipe / plain:.3f}x", "<= 1.05x")
    pipe, plain = bench_step_overhead(args.steps, args.repeats, trl_generates=True)
    table.row("(c') the same, TRL generating in the pipeline too (tracking, runtime, ledger, callbacks only)",
              harness.ms(plain), harness.ms(pipe), f"{pipe / plain:.3f}x", "")


if __name__ == "__main__":
    main()
