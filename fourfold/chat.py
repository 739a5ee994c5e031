"""Chat templates: turn a list of {"role", "content"} messages into the text a chat model was trained on.

    template = ChatTemplate.for_model_dir("runs/smollm2")      # tokenizer_config.json's chat_template
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

Templates are Jinja, rendered the way Hugging Face renders them (a sandboxed environment, `bos_token`,
`eos_token`, `add_generation_prompt`, `raise_exception`), so an imported model's own template gives the
text it was fine-tuned on. A model without one (fourfold's own runs) gets DEFAULT_TEMPLATE, a ChatML
layout whose turns end with `<|im_end|>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fourfold.errors import ConfigError

DEFAULT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT_END_OF_TURN = "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")


def _raise(message: str):
    raise TemplateError(message)


def _token_text(value) -> str:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def check_messages(messages) -> None:
    """ConfigError unless `messages` is a non-empty list of {"role": one of ROLES, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ConfigError(f"messages[{i}] must be an object with a role in {', '.join(ROLES)} and a string "
                              f"content; got {m!r:.120}.")


class ChatTemplate:
    """A compiled Jinja chat template with the special tokens it refers to."""

    def __init__(self, source: str = DEFAULT_TEMPLATE, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ConfigError(f"The chat template does not compile ({e}); fix chat_template in "
                              "tokenizer_config.json.") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    @classmethod
    def for_model_dir(cls, path: str | Path | None) -> "ChatTemplate":
        """The template in `path`/tokenizer_config.json, or DEFAULT_TEMPLATE when there is none."""
        config_file = Path(path) / "tokenizer_config.json" if path is not None else None
        if config_file is None or not config_file.is_file():
            return cls()
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{config_file} is not valid JSON ({e}).") from None
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        return cls(source or DEFAULT_TEMPLATE, _token_text(config.get("bos_token")),
                   _token_text(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as text; with add_generation_prompt it ends where the assistant's answer starts."""
        check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise ConfigError(f"The chat template refused these messages: {e}") from None
