"""Turning dataset prompts into model input, the same way for training, the env doctor and evaluation."""

import json
import logging
import re

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


def tools_preamble(tools: list[dict]) -> str:
    """The env's tool schemas as plain text, in the Hermes / Qwen2.5 tool-call format (what chat templates with
    tool support render), for prompts that no chat template renders tools into."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>"
            "\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict] | None:
    """The tool calls an assistant turn wrote in the Hermes / Qwen2.5 format (`<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>`, what `tools_preamble` asks for), parsed with json, never executed as code.
    Arguments written as a JSON string are decoded. None when a <tool_call> block is malformed."""
    calls = []
    for raw in _TOOL_CALL.findall(text):
        try:
            call = json.loads(raw)
            if isinstance(call, dict) and isinstance(call.get("arguments"), str):
                call["arguments"] = json.loads(call["arguments"])
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("arguments", {}), dict):
            return None
        calls.append(call)
    return calls


def place_tools(dataset: Dataset, tokenizer, tools: list[dict], env_name: str, described: bool = False) -> Dataset:
    """Where the env's `get_tools()` schemas go, decided once for the whole run and said in the log: chat prompts
    on a template that renders tools keep them for the template (`tools=`, at render time); text prompts, and chat
    prompts on a template without tools (SmolLM2's), get them written into the prompt as a plain tools preamble
    (a text prompt starts with it; a chat prompt's system message does, or a system message is added), so that
    training, evaluation, the ledger and the doctor all show the model the same prompt. An env whose prompts
    already describe its tools (`describes_tools = True`, e.g. hotel's system prompt) gets no preamble."""
    if not tools or len(dataset) == 0:
        return dataset
    chat = not isinstance(dataset[0]["prompt"], str)
    if chat and supports_tools(tokenizer):
        log.warning("%s.get_tools(): %d schema(s) rendered by the model's chat template (tools=).", env_name,
                    len(tools))
        return dataset
    if described:
        log.warning("%s.get_tools(): %d schema(s) not added to the prompts: %s, and %s.describes_tools says its prompts "
                    "describe the tools.", env_name, len(tools), "the prompts are text" if not chat else
                    "the model's chat template does not render tools", env_name)
        return dataset
    preamble = tools_preamble(tools)

    def add(prompt):
        if isinstance(prompt, str):
            return f"{preamble}\n\n{prompt}"
        messages = [dict(m) for m in prompt]
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{preamble}\n\n{messages[0].get('content') or ''}"
        else:
            messages.insert(0, {"role": "system", "content": preamble})
        return messages

    log.warning("%s.get_tools(): %d schema(s) written into every prompt as a tools preamble (%s).", env_name,
                len(tools), "the prompts are text" if not chat else "the model's chat template does not render tools")
    return _with_prompts(dataset, [add(p) for p in dataset["prompt"]])


def attach_tools(dataset: Dataset, tokenizer, tools: list[dict], env_name: str) -> Dataset:
    """Give the env's tool schemas to the chat template: chat prompts are rendered once, here, with
    `tools=`, into text prompts (TRL then tokenizes them as they are). Prompts that place_tools wrote the
    schemas into (no template tool support) pass unchanged."""
    if not tools or not supports_tools(tokenizer):
        return dataset
    return _with_prompts(dataset, [render_prompt(tokenizer, prompt, tools)[0] for prompt in dataset["prompt"]])


def _with_prompts(dataset: Dataset, prompts: list) -> Dataset:
    """`dataset` with its prompt column replaced (a dataset of prompts only has no rows once the column is gone)."""
    if dataset.column_names == ["prompt"]:
        return Dataset.from_dict({"prompt": prompts})
    return dataset.remove_columns("prompt").add_column("prompt", prompts)


_PLACEHOLDER = "\ue000"  # a private-use character: stands for the assistant turn the model already sampled


def env_turn_text(tokenizer, conversation: list[dict], reply: dict | list[dict], tools: list[dict] | None,
                  ended_with_eos: bool) -> str:
    """The text that follows an assistant turn's sampled tokens: the rest of that turn's closing (what the
    template writes after the content, less the eos the model sampled), the env's reply (one message, or
    several: one tool result per call), and the header of the next assistant turn. `conversation` ends with the assistant turn just sampled; its text is never
    re-encoded (a placeholder stands for it), so the sampled tokens stay exactly as they were."""
    if not isinstance(conversation[0], dict) or conversation[0].get("role") is None:
        raise TypeError("env_turn_text needs chat messages")
    history = conversation[:-1] + [{"role": "assistant", "content": _PLACEHOLDER}]
    before = tokenizer.apply_chat_template(history, tools=tools or None, tokenize=False)
    replies = reply if isinstance(reply, list) else [reply]
    after = tokenizer.apply_chat_template(history + replies, tools=tools or None, add_generation_prompt=True,
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
