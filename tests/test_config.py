"""Every option of every group composes and validates; typos and wrong types fail at compose time."""

import importlib.util

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.config.validate import config_problems
from grpo_pipeline.errors import ConfigError

GROUPS = ["model", "env", "loss", "vllm", "lora", "reward"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONFIG_DIR / g).glob("*.yaml"))]
# Options with a required (???) value that the user supplies.
REQUIRED = {("model", "hub"): ["model.name_or_path=org/some-model"],
            ("env", "custom"): ["env._target_=my_envs.hotel_env.HotelEnv"]}


def test_every_group_has_options():
    for group in GROUPS:
        assert any(g == group for g, _ in OPTIONS), f"conf/{group} has no options"


@pytest.mark.parametrize(("group", "option"), OPTIONS)
def test_every_option_composes_and_validates(compose_cfg, group, option, tmp_path):
    cfg = compose_cfg([f"{group}={option}", *REQUIRED.get((group, option), []), f"output_dir={tmp_path}"])
    assert cfg[group] is not None
    problems = config_problems(cfg)
    if group == "vllm" and option != "off" and importlib.util.find_spec("vllm") is None:  # refused, clearly
        assert any("make install-vllm" in p for p in problems), problems
    elif group == "vllm" and option == "server" and not torch.cuda.is_available():
        assert any("vllm=server needs GPUs" in p for p in problems), problems
    else:
        assert problems == []


def test_every_config_file_has_a_header_comment():
    for path in CONFIG_DIR.rglob("*.yaml"):
        assert path.read_text().startswith("#"), f"{path} lacks a header comment"


def test_typo_in_key_fails_with_full_key(compose_cfg):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(["training.lerning_rate=0.1"])
    assert "training.lerning_rate" in str(e.value.__cause__ or e.value)


def test_typo_in_group_yaml_key_is_caught_by_schema(compose_cfg, tmp_path):
    conf = tmp_path / "conf" / "loss"
    conf.mkdir(parents=True)
    (conf / "typo.yaml").write_text("# a typo\nloss_typ: dapo\n")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        with pytest.raises((ConfigCompositionException, ConfigKeyError)) as e:
            compose("train", overrides=[f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "loss=typo"])
    assert "loss_typ" in str(e.value) + str(e.value.__cause__)


def test_wrong_type_fails(compose_cfg):
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose_cfg(["generation.num_generations=many"])
    assert "generation.num_generations" in str(e.value) + str(e.value.__cause__)


def test_unknown_group_option_fails(compose_cfg):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(["loss=ppo"])
    assert "loss" in str(e.value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["loss.epsilon_high=0.1", "loss.clip_range=0.2"], "loss.epsilon_high=0.1 < loss.clip_range=0.2"),
        (["training.batch_size=6", "generation.num_generations=4"], "does not divide"),
        (["generation.num_generations=1", "training.batch_size=1"], "generation.num_generations=1"),
        (["generation.temperature=0"], "generation.temperature=0"),
        (["generation.top_p=1.5"], "generation.top_p=1.5"),
        (["vllm=colocate", "lora=off", "vllm.weight_sync=adapter"], "vllm.weight_sync=adapter hands vLLM a LoRA"),
        (["vllm.weight_sync=weights"], "vllm.weight_sync=weights with vllm=off"),
        (["vllm=server"], "vllm=server needs GPUs"),
        (["vllm=colocate", "model=tiny"], "the tiny model is built in code"),
        (["vllm=colocate", "vllm.max_model_len=8"], "vllm.max_model_len=8"),
        (["reward.env_weight=0"], "nothing to reward"),
        (["tracking.flush_every_s=0"], "tracking.flush_every_s=0.0: must be > 0"),
        (["tracking.outage_grace_s=-1"], "tracking.outage_grace_s=-1.0"),
        (["training.logging_steps=0"], "training.logging_steps=0: must be >= 1"),
        (["training.max_minutes=0"], "training.max_minutes=0.0"),
        (["model=deepseek_r1_distill_qwen_1_5b", "model.name_or_path=null"], "model.name_or_path"),
    ],
)
def test_invalid_combinations_are_named(compose_cfg, overrides, expected, tmp_path):
    if torch.cuda.is_available() and ("on a CPU" in expected or "needs GPUs" in expected):
        pytest.skip("a CPU-only refusal")
    cfg = compose_cfg([*overrides, f"output_dir={tmp_path}"])
    problems = config_problems(cfg)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("loss.loss_type=ppo", "loss.loss_type"),
        ("runtime.on_error=ignore", "runtime.on_error"),
        ("vllm.weight_sync=merged", "vllm.weight_sync"),
        ("model.dtype=float8", "model.dtype"),
        ("runtime.generation_dtype=half", "runtime.generation_dtype"),
    ],
)
def test_choice_fields_refuse_unknown_values_at_compose(compose_cfg, override, key):
    """Choice fields are Enums in the schema: OmegaConf names the key and lists the allowed values."""
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigError)) as e:
        compose_cfg([override])
    text = str(e.value) + str(e.value.__cause__)
    assert f"full_key: {key}" in text
    assert "expected one of" in text


def test_all_problems_reported_at_once(compose_cfg, tmp_path):
    from grpo_pipeline.config.validate import check_config

    cfg = compose_cfg(["generation.temperature=0", "loss.kl_coef=-1", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert "generation.temperature" in str(e.value) and "loss.kl_coef" in str(e.value)


def test_colocate_tensor_parallel_must_divide_the_processes(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = compose_cfg(["vllm=colocate", "vllm.tensor_parallel_size=2", f"output_dir={tmp_path}"])
    assert any("vllm.tensor_parallel_size=2 does not divide the 3 training process(es)" in p
               for p in config_problems(cfg))


def test_a_config_error_is_reported_before_torch_or_transformers_load(tmp_path):
    """Reported in seconds: the check runs before the heavy imports (measured ~2 s on 2 cores)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "grpo_pipeline", "training.batch_size=6"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "training.batch_size=6" in proc.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "hydra" in imported and not imported & {"torch", "transformers", "trl", "peft", "mlflow"}


@pytest.mark.parametrize("environ", [{"ACCELERATE_USE_FSDP": "true"},
                                     {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
                                     {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"}],
                         ids=["fsdp", "zero3", "zero3-json"])
def test_sharded_parameters_are_refused_at_startup_with_the_reason(compose_cfg, tmp_path, monkeypatch, environ):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    problems = config_problems(compose_cfg([f"output_dir={tmp_path}"]))
    assert any("not collective-safe" in p and "ZeRO-2" in p for p in problems), problems


def test_deepspeed_zero2_is_not_refused(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert not any("collective" in p for p in config_problems(compose_cfg([f"output_dir={tmp_path}"])))
