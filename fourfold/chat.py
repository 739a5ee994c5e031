"""Chat templates: turn a list of {"role", "content"} messages into the text a chat model was trained on.

    template = ChatTemplate.for_model_dir("runs/smollm2")      # tokenizer_config.json's chat_template
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

Templates are Jinja, rendered the way Hugging Face renders them (a sandboxed environment, `bos_token`,
`eos_token`, `add_generation_prompt`, `raise_exception`), so an imported model's own template gives the
text it was fine-tuned on. A model without one (fourfold's own runs) gets DEFAULT_TEMPLATE, a ChatML
layout whose turns end with `<|im_end|>`.

For training on chat data, `render_with_spans` also says which characters are the assistant's to learn:

    text, spans = template.render_with_spans(messages)   # spans: [(start, end)] of each assistant turn

A span covers the assistant's content and its end-of-turn text (`<|im_end|>`, `<|eot_id|>`, `</s>`...),
not the generation-prompt header before it nor the whitespace after it. Spans come from rendering the
conversation incrementally: the text of messages[:k] with the generation prompt ends where assistant
message k starts, and the text of messages[:k+1] ends where it ends. A template whose prefixes are not
prefixes of the whole conversation (one that rewrites earlier turns) falls back to finding each
assistant content in the rendered text, followed by a known end-of-turn marker.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fourfold.errors import ConfigError

DEFAULT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT_END_OF_TURN = "<|im_end|>"
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "</s>")
ROLES = ("system", "user", "assistant", "tool")


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (Hugging Face's assistant-mask markers) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        """The block's body, as if the tags were not there."""
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


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
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
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
        """The template in `path`/tokenizer_config.json, or in `path`/chat_template.jinja beside it (where recent
        transformers save it), or DEFAULT_TEMPLATE when there is none."""
        if path is None:
            return cls()
        config_file, jinja_file = Path(path) / "tokenizer_config.json", Path(path) / "chat_template.jinja"
        template = cls.from_config_file(config_file) if config_file.is_file() else cls()
        if template.source == DEFAULT_TEMPLATE and jinja_file.is_file():
            return cls(cls.from_jinja_file(jinja_file).source, template.bos_token, template.eos_token)
        return template

    @classmethod
    def from_config_file(cls, config_file: str | Path) -> "ChatTemplate":
        """The template of a tokenizer_config.json file (DEFAULT_TEMPLATE when it holds none)."""
        config_file = Path(config_file)
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{config_file} is not valid JSON ({e}).") from None
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        return cls(source or DEFAULT_TEMPLATE, _token_text(config.get("bos_token")),
                   _token_text(config.get("eos_token")))

    @classmethod
    def from_jinja_file(cls, path: str | Path) -> "ChatTemplate":
        """A template written as a plain Jinja file (no special tokens known)."""
        try:
            return cls(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"Cannot read the chat template file {path} ({e}).") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as text; with add_generation_prompt it ends where the assistant's answer starts."""
        check_messages(messages)
        return self._render(messages, add_generation_prompt)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise ConfigError(f"The chat template refused these messages: {e}") from None

    def render_with_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the whole conversation's text, the [start, end) character span of each assistant turn)."""
        check_messages(messages)
        text = self._render(messages, add_generation_prompt=False)
        spans = self._incremental_spans(messages, text)
        return text, (spans if spans is not None else self._searched_spans(messages, text))

    def _incremental_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]] | None:
        """Spans from rendering each prefix; None when some prefix is not a prefix of `text`."""
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:  # a template may refuse a prefix (reading messages[0] of none, insisting on the last role)
                before = self._render(messages[:k], add_generation_prompt=True)
                after = self._render(messages[:k + 1], add_generation_prompt=False)
            except (ConfigError, TypeError, IndexError, KeyError):
                return None
            if not (text.startswith(after) and after.startswith(before)):
                return None
            end = len(after.rstrip())
            spans.append((len(before), max(end, len(before))))
        return spans

    def _searched_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Fallback: each assistant content found in order in `text`, extended over an end-of-turn marker."""
        spans, cursor = [], 0
        markers = tuple(m for m in (self.eos_token, *END_OF_TURN_MARKERS) if m)
        for message in messages:
            if not message["content"]:
                continue
            start = text.find(message["content"], cursor)
            if message["role"] != "assistant":  # step over it, so an answer repeating a question is found after it
                cursor = cursor if start < 0 else start + len(message["content"])
                continue
            if start < 0:
                raise ConfigError("The chat template changes assistant messages as it renders them, so the "
                                  "trained tokens cannot be located; use a template that keeps each "
                                  "assistant's content verbatim (data.chat_template).")
            end = start + len(message["content"])
            marker = next((m for m in markers if text.startswith(m, end)), "")
            spans.append((start, end + len(marker)))
            cursor = end + len(marker)
        return spans
