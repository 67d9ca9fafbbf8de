"""Each config group option for real: every loss trains a step, LoRA merge, reward presets, vLLM launch plans."""

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import tiny_overrides
from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.recipe import train
from grpo_pipeline.rewards.presets import accuracy, extract_answer, length_penalty, step
from grpo_pipeline.tools.launch import plan

LOSSES = sorted(p.stem for p in (CONFIG_DIR / "loss").glob("*.yaml"))


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_trains_one_step_and_reaches_trl(compose_cfg, tmp_path, loss):
    cfg = compose_cfg([*tiny_overrides(tmp_path), f"loss={loss}", "training.max_steps=1", "tracking.enabled=false"])
    result = train(cfg, launch_dir=str(tmp_path))
    assert result.steps == 1
    args = torch.load(Path(result.model_path) / "training_args.bin", weights_only=False)
    assert args.loss_type == loss
    assert args.beta == cfg.loss.kl_coef and args.epsilon == cfg.loss.clip_range
    assert args.epsilon_high == cfg.loss.epsilon_high  # TRL uses epsilon when None
    assert args.mask_truncated_completions == cfg.loss.mask_truncated_completions
    assert args.importance_sampling_level == cfg.loss.importance_sampling_level


def test_loss_options_carry_their_papers_settings(compose_cfg, tmp_path):
    dapo = compose_cfg(["loss=dapo", f"output_dir={tmp_path}"]).loss
    assert dapo.epsilon_high == 0.28 and dapo.mask_truncated_completions and dapo.kl_coef == 0
    assert compose_cfg(["loss=dr_grpo", f"output_dir={tmp_path}"]).loss.scale_rewards == "none"
    assert compose_cfg(["loss=cispo", f"output_dir={tmp_path}"]).loss.epsilon_high >= 1.0


def test_an_envs_tuned_settings_apply_to_that_env_only_and_the_command_line_wins(compose_cfg, tmp_path):
    tuned = sorted(p.stem for p in (CONFIG_DIR / "tuned").glob("*.yaml"))
    assert tuned and set(tuned) <= {p.stem for p in (CONFIG_DIR / "env").glob("*.yaml")}  # no orphan file
    assert compose_cfg([f"output_dir={tmp_path}"]).generation.temperature == 1.2  # the default env: arithmetic
    hotel = compose_cfg(["env=hotel", "loss=dapo", f"output_dir={tmp_path}"])  # the command
    assert hotel.generation.temperature == 1.0  # train.yaml's
    assert hotel.loss.kl_coef == 0.04 and hotel.loss.loss_type == "dapo"  # tuned/hotel.yaml beats the loss group
    assert (hotel.training.batch_size, hotel.generation.oversample, hotel.training.max_steps) == (8, 1, 80)
    assert compose_cfg(["env=hotel", "loss.kl_coef=0", f"output_dir={tmp_path}"]).loss.kl_coef == 0
    assert compose_cfg([f"output_dir={tmp_path}"]).loss.kl_coef == 0  # arithmetic keeps dapo's
    assert compose_cfg(["env=custom", f"output_dir={tmp_path}"]).generation.temperature == 1.0  # no file: skipped
    assert compose_cfg(["generation.temperature=0.9", f"output_dir={tmp_path}"]).generation.temperature == 0.9


def test_lora_merge_writes_full_weights(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path), "lora.save_merged=true", "training.max_steps=1",
                       "tracking.enabled=false"])
    result = train(cfg, launch_dir=str(tmp_path))
    assert (Path(result.model_path) / "adapter_model.safetensors").exists()
    assert (Path(result.run_dir) / "model_merged" / "model.safetensors").exists()


def test_reward_presets_values():
    assert extract_answer("48 + 24 = 72. Final Answer: 72") == "72"
    assert extract_answer("so <answer> 9 </answer>") == "9" and extract_answer("1 then 2") == "2"
    assert accuracy(None, ["= 72. Final Answer: 72", "Final Answer: 70", "<answer>72</answer>"], answer=[72] * 3) == [
        1.0, 0.0, 1.0]
    assert length_penalty(None, ["a"] * 3, completion_ids=[[0] * 100, [0] * 200, [0] * 300], target_length=200) == [
        1.0, 1.0, 0.5]
    assert step(None, ["Step 1: add\nStep 2: carry\n3. done", "no steps"], step_bonus=0.1) == [
        pytest.approx(0.3), 0.0]


def test_combined_reward_logs_each_component(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path), "reward=combined", "reward.env_weight=1.0"])
    train(cfg, launch_dir=str(tmp_path))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])[0]
    for name in ("env", "accuracy", "length_penalty", "step"):
        assert f"rewards/{name}/mean" in run.data.metrics, name


def test_reward_component_needing_a_missing_column_fails_before_weights(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=hotel"]), "reward=accuracy"])
    with pytest.raises(ConfigError, match=r"reward.components.accuracy needs dataset column\(s\) \['answer'\]"):
        train(cfg, launch_dir=str(tmp_path))
    assert not (tmp_path / "mlflow.db").exists()


def test_user_reward_component_by_target(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, limit=3, **_):\n    return [float(len(c) <= limit) for c in completions]\n")
    cfg = compose_cfg([*tiny_overrides(tmp_path), "+reward.components.short._target_=my_rewards.short",
                       "+reward.components.short.weight=0.5", "+reward.components.short.limit=2"])
    train(cfg, launch_dir=str(tmp_path))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])[0]
    assert "rewards/short/mean" in run.data.metrics


def test_vllm_server_plan_splits_gpus():
    p = plan(8, "org/model", server_gpus=2, tensor_parallel_size=1, host="127.0.0.1", port=8000,
             overrides=["vllm=server", "env=hotel"])
    assert p.server_gpus == [0, 1] and p.train_gpus == [2, 3, 4, 5, 6, 7]
    assert p.server_cmd[:4] == ["trl", "vllm-serve", "--model", "org/model"]
    assert p.server_cmd[p.server_cmd.index("--data-parallel-size") + 1] == "2"
    assert p.train_cmd[:4] == ["accelerate", "launch", "--num_processes", "6"] and p.train_cmd[-1] == "env=hotel"
    assert "CUDA_VISIBLE_DEVICES=0,1 trl vllm-serve" in p.shell()
    assert "CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 accelerate launch" in p.shell()
    tp = plan(8, "m", server_gpus=4, tensor_parallel_size=2, host="0.0.0.0", port=9000, overrides=[])
    assert tp.server_cmd[tp.server_cmd.index("--data-parallel-size") + 1] == "2"
    assert tp.health_url == "http://127.0.0.1:9000/health"


@pytest.mark.parametrize(
    ("gpus", "server", "tp", "expected"),
    [(8, 8, 1, "leaves none of the 8 GPUs"), (8, 3, 2, "does not divide vllm.server_gpus=3"),
     (8, 0, 1, "needs at least one GPU")],
)
def test_vllm_server_plan_errors(gpus, server, tp, expected):
    with pytest.raises(ConfigError, match=expected):
        plan(gpus, "m", server, tp, "h", 1, [])


def test_launcher_dry_run_prints_commands(capsys):
    from grpo_pipeline.tools.launch import main

    main(["--num-gpus", "8", "--dry-run", "model=deepseek_r1_distill_qwen_1_5b", "vllm.server_gpus=2"])
    out = capsys.readouterr().out
    assert "CUDA_VISIBLE_DEVICES=0,1 trl vllm-serve --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B" in out
    assert "accelerate launch --num_processes 6 -m grpo_pipeline" in out
