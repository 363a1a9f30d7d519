"""Chat templates rendered the way Hugging Face transformers renders them (``apply_chat_template``).

transformers (checked against 5.x, see tests/frontend/test_tokenizer.py) compiles the template in
a sandboxed, immutable jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text, and two globals:
``raise_exception`` and ``strftime_now``. The template sees ``messages``,
``add_generation_prompt`` and the special tokens by name (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The chat template refused the messages (its own raise_exception) or does not compile."""


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; for
    rendering it is transparent, as in transformers."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template does not compile: {e} (line {e.lineno})") from None


def render_chat(source: str, messages: list[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **extra: object) -> str:
    """The prompt text ``messages`` become under the template ``source``."""
    try:
        return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               **(special_tokens or {}), **extra)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template failed on these messages: {e}") from None


# The template of the built-in byte-level tokenizer (presets without a checkpoint).
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
