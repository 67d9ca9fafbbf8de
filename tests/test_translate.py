"""The bridge for users of other GRPO CLIs: every flag translated or rejected by name."""

import pytest

from grpo_pipeline.errors import ConfigError
from grpo_pipeline.tools.translate import translate

FULL = ["--train", "--trainer", "grpo", "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "--rl-env-module", "my_envs.hotel_env", "--rl-env-class", "HotelEnv",
        "--rl-env-config", '{"max_turns": 5, "difficulty": "hard", "tags": ["a", "b"]}',
        "--rl-num-generations", "4", "--rl-max-new-tokens", "256", "--rl-kl-coef", "0.1",
        "--rl-clip-range", "0.2", "--rl-loss-type", "dapo", "--rl-mask-truncated-completions",
        "--rl-temperature", "0.8", "--rl-top-k", "50", "--rl-top-p", "0.95",
        "--use-vllm", "--vllm-mode", "server", "--vllm-server-url", "http://10.0.0.1:8000",
        "--vllm-server-gpus", "2", "--vllm-tensor-parallel-size", "2", "--vllm-gpu-memory-utilization", "0.5",
        "--lr", "1e-5", "--epochs", "1", "--batch-size", "4", "--peft", "--lora-r", "16", "--lora-alpha", "32",
        "--lora-dropout", "0.1"]


def test_every_flag_is_translated():
    out = translate(FULL)
    expected = {
        "model=hub", 'model.name_or_path="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"', "env=custom",
        "env._target_=my_envs.hotel_env.HotelEnv", "+env.max_turns=5", '+env.difficulty="hard"',
        '+env.tags=["a","b"]', "generation.num_generations=4", "generation.max_new_tokens=256",
        "loss.kl_coef=0.1", "loss.clip_range=0.2", "loss=grpo", "loss.loss_type=dapo",
        "loss.mask_truncated_completions=true", "generation.oversample=1",
        "generation.temperature=0.8", "generation.top_k=50", "generation.top_p=0.95", "vllm=server",
        'vllm.server_base_url="http://10.0.0.1:8000"', "vllm.server_gpus=2", "vllm.tensor_parallel_size=2",
        "vllm.gpu_memory_utilization=0.5", "training.learning_rate=1e-05", "training.num_epochs=1.0",
        "training.max_steps=-1", "training.batch_size=4", "lora=default", "lora.r=16", "lora.alpha=32",
        "lora.dropout=0.1",
    }
    assert set(out) == expected


def test_translation_composes(compose_cfg, tmp_path):
    cfg = compose_cfg([*translate(FULL), f"output_dir={tmp_path}"])
    assert cfg.env._target_ == "my_envs.hotel_env.HotelEnv" and cfg.env.max_turns == 5
    assert cfg.env.tags == ["a", "b"] and cfg.loss.loss_type == "dapo" and cfg.vllm.mode == "server"
    assert cfg.loss.epsilon_high is None and cfg.loss.kl_coef == 0.1  # the loss type alone, not DAPO's preset
    assert cfg.model.name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B" and cfg.lora.r == 16


def test_env_config_onto_a_shipped_env(compose_cfg, tmp_path):
    out = translate(["--rl-env-config", '{"max_turns": 2}'])
    assert "++env.max_turns=2" in out and "lora=off" in out  # no --peft: those CLIs fine-tune fully
    cfg = compose_cfg(["env=hotel", *out, f"output_dir={tmp_path}"])
    assert cfg.env.max_turns == 2


def test_use_vllm_defaults_to_colocate():
    assert "vllm=colocate" in translate(["--use-vllm"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-path", "x.json"], "--data-path is not supported: GRPO envs own their data"),
        (["--trainer", "sft"], "--trainer sft is not supported"),
        (["--rl-env-config", "{max_turns: 5}"], "--rl-env-config is not valid JSON"),
        (["--rl-env-config", "[1, 2]"], "must be a JSON object"),
        (["--rl-env-config", '{"a": 1'], "is not valid JSON"),
        (["--rl-env-module", "m"], "--rl-env-module and --rl-env-class go together"),
        (["--rl-loss-type", "ppo"], "--rl-loss-type ppo: use one of"),
        (["--vllm-mode", "server"], "--vllm-mode has no effect without --use-vllm"),
        (["--use-vllm", "--vllm-mode", "remote"], "--vllm-mode remote: use colocate or server"),
        (["--lora-r", "8"], "--lora-r needs --peft"),
        (["--gradient-checkpointing"], "unknown flag(s) ['--gradient-checkpointing']"),
        (["--rl-num-generations", "four"], "invalid int value"),
    ],
)
def test_rejected_flags_are_named(flags, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as e:
        translate(flags)
    assert message in (str(e.value) + capsys.readouterr().err)


def test_cli_prints_overrides(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", "translate", "--", "--rl-kl-coef", "0.3",
                           "--peft"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("python -m grpo_pipeline loss=grpo lora=default")
    assert " loss.kl_coef=0.3 " in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "grpo_pipeline", "translate", "--", "--rl-env-config", "{"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 1 and "--rl-env-config is not valid JSON" in bad.stderr


QUICK_START = ["llm", "--train", "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "--trainer", "grpo",
               "--rl-env-module", "my_envs.hotel_env", "--rl-env-class", "HotelEnv",
               "--rl-num-generations", "4", "--rl-max-new-tokens", "256", "--project-name", "grpo-agent"]


def test_the_documents_quick_start_composes_to_the_documents_values(compose_cfg, tmp_path):
    """Flags not given mean what they mean in the documents (their parameter table), not this project's recipe."""
    cfg = compose_cfg([*translate(QUICK_START), f"output_dir={tmp_path}"])
    g, t, loss = cfg.generation, cfg.training, cfg.loss
    assert (g.num_generations, g.max_new_tokens, g.temperature, g.top_k, g.top_p) == (4, 256, 1.0, 50, 1.0)
    assert g.oversample == 1 and g.resample_flat == 0  # no dynamic sampling
    assert (loss.loss_type, loss.kl_coef, loss.clip_range, loss.mask_truncated_completions) == ("grpo", 0.1, 0.2,
                                                                                                 False)
    assert loss.epsilon_high is None
    assert (t.learning_rate, t.num_epochs, t.max_steps, t.batch_size) == (1e-5, 1.0, -1, 4)
    assert cfg.lora.enabled is False and cfg.tracking.experiment_name == "grpo-agent"
    assert cfg.model.name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"


def test_loss_preset_takes_the_whole_preset_and_flags_still_win(compose_cfg, tmp_path):
    cfg = compose_cfg([*translate(["--rl-loss-type", "dapo", "--loss-preset"]), f"output_dir={tmp_path}"])
    assert cfg.loss.epsilon_high == 0.28 and cfg.loss.kl_coef == 0.0 and cfg.loss.mask_truncated_completions
    cfg = compose_cfg([*translate(["--rl-loss-type", "dapo", "--loss-preset", "--rl-kl-coef", "0.05"]),
                       f"output_dir={tmp_path}"])
    assert cfg.loss.kl_coef == 0.05 and cfg.training.learning_rate == 1e-5


def test_the_printout_names_what_this_project_adds(capsys):
    from grpo_pipeline.tools.translate import main

    main(["--", *QUICK_START])
    captured = capsys.readouterr()
    assert captured.out.startswith("python -m grpo_pipeline model=hub")
    assert "eval.enabled=false" in captured.err and "ledger.enabled=false" in captured.err


def test_only_the_llm_task_is_taken():
    with pytest.raises(ConfigError, match="task 'text-classification' is not supported"):
        translate(["text-classification", "--train"])
