"""A config fuzz test: >= 200 malformed override sets. Each must end in a clear error, within seconds,
before weights load, without a traceback in the message, an MLflow run or an output model."""

import dataclasses
import time

import pytest

import grpo_pipeline
import grpo_pipeline.recipe as recipe
from grpo_pipeline.config.schema import TrainConfig
from grpo_pipeline.errors import PipelineError
from grpo_pipeline.tools.translate import translate

SECTIONS = ["model", "loss", "vllm", "lora", "reward", "generation", "training", "runtime", "eval", "tracking", "check"]


def _field_cases() -> list[list[str]]:
    cases = []
    for section in dataclasses.fields(TrainConfig):
        if not dataclasses.is_dataclass(section.type):
            continue
        for f in dataclasses.fields(section.type):
            key = f"{section.name}.{f.name}"
            if f.type in (int, float, "int", "float"):
                cases += [[f"{key}=abc"], [f"{key}=[1,2]"]]
            elif f.type in (bool, "bool"):
                cases += [[f"{key}=maybe"], [f"{key}={{a:1}}"]]
    return cases


UNKNOWN_KEYS = [[f"{s}.{typo}=1"] for s in SECTIONS for typo in ("lerning_rate", "kl_coeff", "size")]
OUT_OF_RANGE = [
    ["loss.epsilon_high=0.1"], ["loss.clip_range=0"], ["loss.clip_range=-1"], ["loss.kl_coef=-0.5"],
    ["loss.loss_type=ppo"], ["loss.scale_rewards=sometimes"], ["loss.num_iterations=0"],
    ["generation.num_generations=1", "training.batch_size=1"], ["generation.num_generations=0"],
    ["generation.temperature=0"], ["generation.temperature=-1"], ["generation.top_p=0"], ["generation.top_p=2"],
    ["generation.top_k=-3"], ["generation.max_new_tokens=0"], ["training.batch_size=6"], ["training.batch_size=0"],
    ["training.gradient_accumulation_steps=0"], ["training.learning_rate=0"], ["training.learning_rate=-1e-5"],
    ["training.max_steps=0"], ["training.max_steps=-1", "training.num_epochs=0"], ["runtime.max_concurrency=0"],
    ["runtime.episode_timeout_s=0"], ["runtime.on_error=ignore"], ["eval.num_prompts=0"], ["eval.batch_size=0"],
    ["eval.num_prompts=100000"], ["reward.env_weight=-1"], ["reward.env_weight=0"], ["vllm=colocate"],
    ["vllm=server"], ["vllm.mode=fast"], ["vllm=colocate", "vllm.gpu_memory_utilization=2"],
    ["model.source=torrent"], ["model.dtype=float8"], ["model=hub"], ["model=hub", "model.name_or_path=null"],
    ["model.source=gguf", "model.gguf_package=null"], ["model.source=gguf", "model.gguf_package=nopkg_zz"],
    ["env.num_samples=0"], ["env.min_value=90", "env.max_value=10"], ["env.operations=[/]"],
    ["env.format_weight=0.9"], ["env=hotel", "env.difficulty=extreme"], ["env=hotel", "env.max_turns=0"],
    ["resume=/no/such/run/dir"], ["generation.num_generations=3"], ["model.chat_template=trl:nope"],
    ["model.chat_template=/no/such.jinja"],
]
UNKNOWN_OPTIONS = [[f"{g}=nonexistent_option"] for g in ("model", "env", "loss", "vllm", "lora", "reward")]
BAD_TARGETS = [
    ["env=custom"], ["env=custom", "env._target_=NoDots"], ["env=custom", "env._target_=no_such_mod.Env"],
    ["env=custom", "env._target_=grpo_pipeline.envs.arithmetic.Nope"],
    ["env=custom", "env._target_=grpo_pipeline.envs.loader.load_env"],
    ["env=custom", "env._target_=grpo_pipeline.config.schema.ModelConfig"],
    ["env._target_=json.JSONDecoder"], ["env=custom", "env._target_=os.path.Nope"],
    ["reward=combined", "reward.components.accuracy._target_=no.such.fn"],
    ["reward=combined", "~reward.components.accuracy._target_"],
    ["+reward.components.x._target_=grpo_pipeline.rewards.presets.nope"],
    ["+reward.components.x.weight=1"],
]
BAD_KWARGS = [["+env.max_turn=2"], ["+env.difficulty=hard"], ["env=hotel", "+env.num_sample=3"],
              ["env=hotel", "+env.operations=[+]"], ["+env.seed_value=1"], ["env=hotel", "+env.max_turnz=4"],
              ["reward=accuracy", "env=hotel"], ["reward=combined", "env=hotel"]]
MALFORMED_SYNTAX = [["training.learning_rate="], ["=3"], ["loss.kl_coef=0.1)"], ["training.batch_size=[4"],
                    ["env.operations=[+,"], ["+env=1"], ["model=tiny,smollm2_135m"], ["generation=fast"]]

CASES = UNKNOWN_KEYS + _field_cases() + OUT_OF_RANGE + UNKNOWN_OPTIONS + BAD_TARGETS + BAD_KWARGS + MALFORMED_SYNTAX
MALFORMED_JSON = ["{", "{max_turns: 5}", "[1,2]", '{"a": }', "nul", '{"a": 1,}', "'single'", '{"a" 1}', "5",
                  '"just a string"']


def test_there_are_at_least_200_cases():
    assert len(CASES) + len(MALFORMED_JSON) >= 200, len(CASES)


@pytest.fixture
def no_weights(monkeypatch):
    monkeypatch.setattr(recipe, "load_model", lambda *a, **k: pytest.fail("weights loaded for a bad config"))


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o)[:60])
def test_malformed_config_fails_fast_and_clearly(overrides, tmp_path, monkeypatch, no_weights):
    monkeypatch.chdir(tmp_path)
    base = ["model=tiny", f"output_dir={tmp_path / 'run'}", f"tracking.tracking_uri=sqlite:///{tmp_path}/m.db"]
    start = time.monotonic()
    with pytest.raises(PipelineError) as e:
        grpo_pipeline.train(base + overrides)
    assert time.monotonic() - start < 10
    message = str(e.value)
    assert message and "Traceback" not in message and len(message.splitlines()) <= 25
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "run" / "model").exists()


@pytest.mark.parametrize("raw", MALFORMED_JSON)
def test_malformed_env_config_json(raw):
    with pytest.raises(PipelineError, match="--rl-env-config"):
        translate(["--rl-env-config", raw])


def test_unwritable_tracking_uri_fails_before_training(tmp_path, monkeypatch, no_weights):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError, match="tracking.tracking_uri='sqlite:////proc/nope/m.db' is not usable"):
        grpo_pipeline.train(["model=tiny", f"output_dir={tmp_path / 'run'}",
                             "tracking.tracking_uri=sqlite:////proc/nope/m.db"])


def test_unreachable_tracking_server_fails_in_seconds(tmp_path, monkeypatch, no_weights):
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(PipelineError, match="tracking.tracking_uri='http://127.0.0.1:9' is not usable"):
        grpo_pipeline.train(["model=tiny", f"output_dir={tmp_path / 'run'}", "tracking.tracking_uri=http://127.0.0.1:9"])
    assert time.monotonic() - start < 60
