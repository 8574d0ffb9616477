"""Chat messages -> prompt text through the model's own chat template (Jinja, sandboxed as
transformers renders it: a template comes with a checkpoint and is not trusted)."""

from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specpilot.core.errors import SpecPilotError


def _raise(message: str):
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise SpecPilotError(f"the chat template does not parse: {e}") from None

    def render(self, messages: list[dict]) -> str:
        """The prompt for ``messages`` (role / content), ending where the assistant's reply begins."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        except TemplateError as e:
            raise SpecPilotError(f"the chat template refused these messages: {e}") from None
