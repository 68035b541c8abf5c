"""The Jinja environment chat templates are compiled in: the one transformers' `apply_chat_template`
uses, so a template from the Hub renders here exactly as it does there.

A sandbox that allows no mutation of the template's inputs (`ImmutableSandboxedEnvironment`),
`trim_blocks` / `lstrip_blocks`, the `loopcontrols` extension (`{% break %}`), the `{% generation %}`
tag that marks assistant text for transformers' assistant-token masks (rendered here as its body:
no mask is asked of this engine), `raise_exception`, `strftime_now`, a `tojson` that does not
escape HTML and takes json.dumps' options, and the guarded `dict` / `namespace` globals.

Every place that compiles a chat template goes through `compile_chat_template`."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class ChatTemplateError(jinja2.exceptions.TemplateError, ValueError):
    """A template's own `raise_exception(...)`: jinja2's TemplateError as in transformers, and a
    ValueError, as bad input is everywhere else in prefixkv."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt's text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (its attributes reach
    CPython internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names (a way out of the sandbox)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """A new environment configured as transformers configures its chat-template one."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    return chat_template_environment()


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """`source` compiled (kept in a small cache: clients resend the same few templates). Raises
    jinja2's TemplateSyntaxError for a template that does not compile."""
    return _environment().from_string(source)
