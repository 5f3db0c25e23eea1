"""The model's tokenizer: tokenizer.json (the `tokenizers` library) and tokenizer_config.json's
chat template (Jinja2, rendered in a sandbox like transformers' apply_chat_template)."""

from __future__ import annotations

import json
import os

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from v4train.hf_checkpoint import read_json


class NotPrefixes(ValueError):
    """The chat template renders a conversation otherwise than as its earlier renderings went on."""


class TokenizerError(ValueError):
    pass


def _raise_exception(message):
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, directory: str):
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise TokenizerError(f"{path}: not found (the tokenizer directory needs tokenizer.json)")
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as e:
            raise TokenizerError(f"{path}: cannot load ({e})") from None
        config_path = os.path.join(directory, "tokenizer_config.json")
        self.config = read_json(config_path, TokenizerError) if os.path.exists(config_path) else {}
        self.directory = directory
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{config_path}: chat_template must be a string, got {type(template).__name__}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception  # as transformers' apply_chat_template provides it
        try:
            self._template = env.from_string(template) if template else None
        except TemplateError as e:
            line = f" (line {e.lineno} of the template)" if getattr(e, "lineno", None) else ""
            raise TokenizerError(f"{config_path}: its chat_template does not compile: {e}{line}") from None
        self.eos_token = self._special("eos_token")
        self.bos_token = self._special("bos_token")

    def _special(self, key):
        value = self.config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self._template is None:
            raise TokenizerError(f"{self.directory}/tokenizer_config.json has no chat_template")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:  # the template's own raise_exception(), or an error while rendering
            raise ValueError(f"the chat template of {self.directory} refused this conversation: {e}") from None

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and, per token, whether it is assistant output.

        Each message's span is the text its rendering adds to the conversation so far; before an
        assistant message, the generation prompt (e.g. '<|assistant|>\\n') belongs to the prompt.
        Spans are tokenized one by one, so a boundary never merges two spans' tokens.
        """
        ids, mask, done = [], [], ""
        for i, message in enumerate(messages):
            is_assistant = message.get("role") == "assistant"
            if is_assistant:
                prompt = self.render(messages[:i], add_generation_prompt=True)
                self._append(prompt, done, ids, mask, False)
                done = prompt
            text = self.render(messages[: i + 1])
            self._append(text, done, ids, mask, is_assistant)
            done = text
        return ids, mask

    def encode_turns(self, messages: list[dict]) -> list[tuple[list[int], list[bool]]]:
        """For a template that rewrites earlier turns (Qwen3's drops their reasoning, and adds an
        empty one to the last assistant turn only), one example per assistant turn: the conversation
        up to that turn as the template renders it when the model writes it, the turn its only
        target."""
        out = []
        for i, message in enumerate(messages):
            if message.get("role") == "assistant":
                ids, mask = [], []
                prompt, text = self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1])
                history = self.render(messages[:i]) if not text.startswith(prompt) else prompt
                if prompt.startswith(history) and prompt != history:
                    # The template rewrote the history itself (Qwen3's keeps an empty reasoning block on
                    # the last assistant turn only, so on one before this turn): the prompt is the text
                    # up to this turn's generation prompt, the last one in it.
                    at = text.rfind(prompt[len(history):])
                    prompt = text[: at + len(prompt) - len(history)] if at >= 0 else prompt
                self._append(prompt, "", ids, mask, False)
                self._append(text, prompt, ids, mask, True)
                out.append((ids, mask))
        return out

    def _append(self, text, done, ids, mask, flag):
        if not text.startswith(done):
            raise NotPrefixes("the chat template does not render a conversation as its generation prompt "
                              "followed by the assistant's turn; cannot tell which tokens are the assistant's")
        new = self.encode(text[len(done):])
        ids += new
        mask += [flag] * len(new)
