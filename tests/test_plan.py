"""The run plan (config/plan.py): every automatic choice made once before weights load, printed, written to
plan.json and MLflow, and what the run then does; the config given is never changed."""

import json

import torch
import yaml
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from conftest import run_cli, tiny_overrides
from grpo_pipeline import recipe
from grpo_pipeline.config import machine

FOUR_ROWS = ("from datasets import Dataset\nclass Four:\n    def build_dataset(self, tokenizer):\n"
             "        return Dataset.from_list([{'prompt': f'Say {i}'} for i in range(4)])\n"
             "    def score_episode(self, model, tokenizer, completion):\n        return len(completion) % 3 / 2\n")


def test_the_plan_decides_once_and_the_runtime_samples_as_it_says(compose_cfg, tmp_path, monkeypatch, caplog):
    asked, built = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run, also on a GPU host
    monkeypatch.setattr(machine, "sampling_dtype",
                        lambda packed: asked.append(packed) or machine.Choice("bfloat16", "measured 1.4x (a test)"))
    real = recipe.make_rollout
    monkeypatch.setattr(recipe, "make_rollout", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith("runtime.generation_dtype")]
    with caplog.at_level("WARNING"):
        result = recipe.train(compose_cfg([*overrides, "runtime.generation_dtype=null"]), launch_dir=str(tmp_path))
    assert len(asked) == 1  # decided once, before weights loaded
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["backend"] == "runtime" and plan["generation_dtype"] == "bfloat16"
    choice = next(c for c in plan["choices"] if c["key"] == "runtime.generation_dtype")
    assert choice["value"] == "bfloat16" and "measured 1.4x (a test)" in choice["why"]
    assert built[0].sampler.dtype == torch.bfloat16 and built[0].merged.dtype is None  # what the plan said
    assert "Run plan (plan.json):" in caplog.text and "measured 1.4x (a test)" in caplog.text
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id)
    assert run.data.params["plan.backend"] == "runtime"
    assert run.data.params["plan.runtime.generation_dtype"] == "bfloat16"


def test_the_config_given_is_not_changed_and_a_fitted_run_resumes(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "four.py").write_text(FOUR_ROWS)
    overrides = [*tiny_overrides(tmp_path, ["env=custom", "env._target_=four.Four"]), "training.batch_size=16",
                 "training.save_steps=1", "training.max_steps=1"]
    cfg = compose_cfg(overrides)
    recipe.train(cfg, launch_dir=str(tmp_path))
    assert cfg.training.batch_size == 16  # not rewritten in place
    run_dir = tmp_path / "run"
    assert yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["training"]["batch_size"] == 16
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["step"]["training.batch_size"] == 8 and plan["train_prompts"] == 4  # fitted to the 4 rows
    step = next(c for c in plan["choices"] if c["key"] == "step")
    assert "Four has 4 training prompt(s)" in step["why"]
    resumed = recipe.train(compose_cfg([*overrides, "training.max_steps=2", f"resume={run_dir}"]),
                           launch_dir=str(tmp_path))  # the same config as given: nothing to refuse
    assert resumed.steps == 2 and (run_dir / "plan-step1.json").exists()


def test_plan_prints_the_plan_and_trains_nothing(tmp_path):
    done = run_cli(["model=tiny", "env=arithmetic", "env.num_samples=24", "eval.enabled=false", "--plan",
                    f"output_dir={tmp_path / 'run'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Run plan (plan.json):" in done.stdout and "backend" in done.stdout and "step" in done.stdout
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "mlflow.db").exists()


def test_the_learning_rate_follows_the_model_and_the_fine_tuning_mode(compose_cfg, caplog):
    """SmolLM2 + LoRA keeps the rate tuned for it; any other model, or SmolLM2 fully fine-tuned, gets its mode's
    generic rate; a rate given wins; the applied config is what TRL receives."""
    from grpo_pipeline.config.grpo_args import build_grpo_config
    from grpo_pipeline.config.plan import FULL_LR, LORA_LR, recipe_choices

    def lr(overrides):
        cfg = compose_cfg([*overrides, "output_dir=/tmp/x"])
        recipe, lines = recipe_choices(cfg)
        line = next(c for c in lines if c.key == "training.learning_rate")
        return recipe.get("training.learning_rate", cfg.training.learning_rate), line.why

    assert lr([]) == (3e-4, "conf/recipe/smollm2_135m_default.yaml: tuned for smollm2_135m with LoRA")
    hub = ["model=hub", "model.name_or_path=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"]
    value, why = lr([*hub, "lora=off"])
    assert value == FULL_LR == 1e-5 and "full fine-tuning of hub, not tuned here" in why
    assert lr([*hub, "lora=default"])[0] == LORA_LR == 1e-4
    assert lr(["lora=off"])[0] == FULL_LR  # SmolLM2's 3e-4 was tuned with LoRA only
    assert lr([*hub, "training.learning_rate=2e-6"]) == (2e-6, "training.learning_rate")
    cfg = compose_cfg([*hub, "lora=off", "output_dir=/tmp/x"])
    applied = cfg.copy()
    for key, v in recipe_choices(cfg)[0].items():
        OmegaConf.update(applied, key, v)
    assert build_grpo_config(applied, "/tmp/x/ck", [1.0], False).learning_rate == 1e-5


def test_epochs_decide_when_given_and_a_step_bound_says_it_wins(compose_cfg, caplog):
    from grpo_pipeline.config.plan import STEPS, recipe_choices

    def steps(overrides):
        return recipe_choices(compose_cfg([*overrides, "output_dir=/tmp/x"]))

    out, _ = steps([])
    assert out["training.max_steps"] == STEPS == 50 and out["training.num_epochs"] == 1.0
    out, lines = steps(["training.num_epochs=3"])
    assert out["training.max_steps"] == -1 and "training.num_epochs=3 decides" in lines[-1].why
    with caplog.at_level("WARNING"):
        out, lines = steps(["training.num_epochs=3", "training.max_steps=20"])
    assert "training.max_steps" not in out and "training.num_epochs=3 is ignored" in caplog.text
    assert steps(["env=hotel"])[0].get("training.max_steps") is None  # hotel's recipe: 80 steps


def test_the_runtimes_vllm_takes_its_settings_from_the_plan(compose_cfg, tmp_path, monkeypatch):
    from grpo_pipeline.config.plan import make_plan
    from grpo_pipeline.envs.runner import EpisodeRunner
    from grpo_pipeline.evaluation.heldout import Split
    from grpo_pipeline.rollout import turns

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = compose_cfg([*tiny_overrides(tmp_path), "vllm=colocate", "vllm.max_model_len=384", "seed=7"])
    env, tokenizer, dataset, tools = recipe.load_env_and_dataset(cfg, render_tools=False)
    plan = make_plan(cfg, env, tokenizer, Split(dataset, None, None), tools, "Arithmetic")
    assert plan.backend == "runtime+vllm"
    assert plan.vllm_engine == {"dtype": "float32", "max_model_len": 384, "sync": "weights", "lora_rank": cfg.lora.r,
                                "gpu_memory_utilization": cfg.vllm.gpu_memory_utilization, "seed": 7}
    started = []
    monkeypatch.setattr(turns, "VllmBackend", lambda path, **settings: started.append((path, settings)) or "engine")
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, [], sampling=recipe.sampling(cfg.generation))
    rollout = turns.make_rollout(plan, env, tokenizer, runner, lambda: "/the/model")
    assert rollout.uses_vllm and not started  # started on first use, not when the rollout is built
    assert rollout._vllm_factory() == "engine" and started == [("/the/model", plan.vllm_engine)]
    assert json.loads(json.dumps(plan.as_dict()))["vllm_engine"]["max_model_len"] == 384  # in plan.json


def test_a_run_whose_length_and_rate_the_plan_decides_starts_and_says_them(compose_cfg, tmp_path):
    # the default config leaves training.max_steps and training.learning_rate null: the run is described (MLflow's
    # description) with what the plan applied, not the nulls given (make run failed on that once)
    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith("training.max_steps")]
    cfg = compose_cfg([*overrides, "training.max_steps=null", "training.learning_rate=null",
                       "training.num_epochs=0.2"])
    result = recipe.train(cfg, launch_dir=str(tmp_path))
    assert result.steps >= 1
    note = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id).data.tags[
        "mlflow.note.content"]
    from grpo_pipeline.config.plan import LORA_LR

    assert "0.2 epochs" in note and f"lr {LORA_LR:g}" in note  # the plan's length and rate (null given)
