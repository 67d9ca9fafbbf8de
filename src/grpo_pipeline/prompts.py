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


_PLACEHOLDER = "\ue000"  # a private-use character: stands for the assistant turn the model already sampled


def env_turn_text(tokenizer, conversation: list[dict], reply: dict, tools: list[dict] | None,
                  ended_with_eos: bool) -> str:
    """The text that follows an assistant turn's sampled tokens: the rest of that turn's closing (what the
    template writes after the content, less the eos the model sampled), the env's reply, and the header
    of the next assistant turn. `conversation` ends with the assistant turn just sampled; its text is never
    re-encoded (a placeholder stands for it), so the sampled tokens stay exactly as they were."""
    if not isinstance(conversation[0], dict) or conversation[0].get("role") is None:
        raise TypeError("env_turn_text needs chat messages")
    history = conversation[:-1] + [{"role": "assistant", "content": _PLACEHOLDER}]
    before = tokenizer.apply_chat_template(history, tools=tools or None, tokenize=False)
    after = tokenizer.apply_chat_template(history + [reply], tools=tools or None, add_generation_prompt=True,
                                          tokenize=False)
    if not after.startswith(before) or _PLACEHOLDER not in before:
        raise ValueError("The chat template renders a conversation differently once a message is added, so the "
                         "env's turns cannot be appended token-exactly. Set model.chat_template to a template that "
                         "appends turns (e.g. trl:qwen2_5).")
    closing = before[before.rindex(_PLACEHOLDER) + len(_PLACEHOLDER):]
    eos = tokenizer.eos_token or ""
    if ended_with_eos and eos and closing.startswith(eos):
        closing = closing[len(eos):]
    return closing + after[len(before):]
