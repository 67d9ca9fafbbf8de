"""Turning dataset prompts into model input, the same way for training, the env doctor and evaluation."""

import logging

from datasets import Dataset

log = logging.getLogger(__name__)


def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools`."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def render_prompt(tokenizer, prompt, tools: list[dict] | None = None) -> tuple[str, bool]:
    """(text, is_chat): chat prompts go through the chat template with a generation prompt."""
    if isinstance(prompt, str):
        return prompt, False
    text = tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=False)
    return text, True


def attach_tools(dataset: Dataset, tokenizer, tools: list[dict], env_name: str) -> Dataset:
    """Give the env's tool schemas to the chat template: chat prompts are rendered once, here, with
    `tools=`, into text prompts (TRL then tokenizes them as they are)."""
    if not tools:
        return dataset
    if not supports_tools(tokenizer):
        log.warning(
            "%s.get_tools() returned %d schemas, but the model's chat template does not render tools: the schemas "
            "are not shown to the model (describe the tools in the prompt, or use a model whose template has tools).",
            env_name,
            len(tools),
        )
        return dataset
    rendered = [render_prompt(tokenizer, prompt, tools)[0] for prompt in dataset["prompt"]]
    return dataset.remove_columns("prompt").add_column("prompt", rendered)
