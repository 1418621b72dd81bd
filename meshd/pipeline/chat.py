"""Chat templates: a conversation turned into the prompt the model was trained on.

The template is the checkpoint's own: ``chat_template.jinja`` when present, else
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{name, template}`` of which "default" is taken), as Hugging Face loads it.  It
is rendered as ``apply_chat_template`` renders it: jinja2's
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, its ``tojson``
(non-ASCII kept, ``indent``), ``raise_exception``, ``strftime_now``, and the
variables ``messages``, ``add_generation_prompt`` (true), ``tools`` and
``documents`` (none) and the special tokens (``bos_token``, ``eos_token``, ..).
The rendered text already holds the special tokens the model expects, BOS
included, so it is tokenized as it is, with no BOS added.

Without a template the prompt is plain: one ``role: content`` line per message,
then ``assistant:``, tokenized as ``/v1/completions`` tokenizes a prompt (BOS
first).

A template comes with the checkpoint, from whoever published it.  The sandbox
keeps it away from Python's internals, and each render is bounded (lines of
template code run, characters written, sizes of ``*`` and ``**``), so a careless
or hostile template fails the request with a message rather than hang or
exhaust the orchestrator.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .generate import prompt_ids
from .tokenizer import Tokenizer

log = logging.getLogger("meshd.pipeline")

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
LEGACY_SPECIALS_FILE = "special_tokens_map.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_RENDER_STEPS = 1_000_000  # lines of template code per render: about a quarter of a second
MAX_PROMPT_CHARS = 4_000_000  # what a render may write
_WIDE_FORMAT = re.compile(r"%[-+ #0]*(\d{5,}|\*)")  # "%0999999999d": a huge string from a tiny one


class ChatTemplateError(ValueError):
    """A conversation the template refuses (``param`` "messages"), or a template that cannot
    render it; the message says which, and is the request's 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Refused(jinja2.TemplateError):
    """The template's own ``raise_exception``."""


class _Bounded(ImmutableSandboxedEnvironment):
    """The sandbox, with ``*``, ``**`` and ``%`` refused where they would build something huge."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if hasattr(seq, "__len__") and isinstance(times, int) and len(seq) * times > MAX_PROMPT_CHARS:
                    raise SecurityError(f"'*' would build {len(seq) * times} items; at most "
                                                       f"{MAX_PROMPT_CHARS}")
        elif operator == "**":
            small_base = isinstance(left, int) and abs(left) <= 1
            if isinstance(right, int) and abs(right) > 1024 and not small_base:
                raise SecurityError(f"'**' with an exponent of {right}; at most 1024")
        elif isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise SecurityError("'%' with a field width of 10000 or more")
        return super().call_binop(context, operator, left, right)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}..{% endgeneration %}``: Hugging Face marks the assistant's part with
    it; rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` without underscore names, as Hugging Face's: no way to dunder attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature: any name is a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _Dict:
    """``dict(..)`` for templates, with nothing else of the type reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: Any) -> None:
    raise _Refused(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON, as Hugging Face's.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def environment() -> jinja2.Environment:
    """Hugging Face's chat template environment, bounded."""
    env = _Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


def fallback_prompt(messages: list[dict[str, Any]]) -> str:
    """The prompt without a template: ``role: content`` lines, then the assistant's turn."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class ChatTemplate:
    """A checkpoint's way of writing a conversation as a prompt (``load``)."""

    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None,
                 where: str = CONFIG_FILE, problem: str | None = None) -> None:
        self.source = source  # the jinja text; None: the plain fallback
        self.special_tokens = dict(special_tokens or {})
        self.where = where  # the file it came from, for messages
        self._problem = problem  # why it cannot render at all, found when loading
        self._template: jinja2.Template | None = None
        if source is not None and problem is None:
            try:
                self._template = environment().from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                self._problem = f"the chat template in {where} is not valid jinja: line {exc.lineno}: {exc}"
            except jinja2.TemplateError as exc:
                self._problem = f"the chat template in {where} cannot be read: {exc}"
        if self._problem is not None:
            log.warning("%s", self._problem)

    @classmethod
    def load(cls, model_dir: str | Path) -> ChatTemplate:
        """The template of the checkpoint in ``model_dir`` (the fallback when it has none).  A
        file that cannot be read fails each chat request naming it, not the orchestrator."""
        model_dir = Path(model_dir)
        config: dict[str, Any] = {}
        specials: dict[str, Any] = {}
        try:
            if (model_dir / CONFIG_FILE).exists():
                config = _json_object(model_dir / CONFIG_FILE)
            if (model_dir / LEGACY_SPECIALS_FILE).exists():
                specials = _json_object(model_dir / LEGACY_SPECIALS_FILE)
            tokens = {name: text for name in SPECIAL_TOKENS
                      if (text := _token_text(config.get(name, specials.get(name)))) is not None}
            if (model_dir / TEMPLATE_FILE).exists():
                return cls((model_dir / TEMPLATE_FILE).read_text(encoding="utf-8"), tokens, TEMPLATE_FILE)
            source = _template_source(config.get("chat_template"))
        except (OSError, ValueError) as exc:
            return cls("", where=CONFIG_FILE, problem=f"the chat template cannot be read: {exc}")
        return cls(source, tokens)

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text for ``messages`` (``{role, content, ..}``, content a string)."""
        if self._problem is not None:
            raise ChatTemplateError(self._problem)
        if self._template is None:
            return fallback_prompt(messages)
        variables = {**self.special_tokens, "messages": messages, "tools": None, "documents": None,
                     "add_generation_prompt": True}
        try:
            return _bounded_render(self._template, variables)
        except ChatTemplateError:
            raise
        except _Refused as exc:
            problem, param = f"refuses this conversation: {exc}", "messages"
        except SecurityError as exc:
            problem, param = f"tried what the sandbox forbids: {exc}", None
        except jinja2.UndefinedError as exc:
            problem, param = f"failed on this conversation: {exc}", "messages"
        except Exception as exc:  # the template's own bug, whatever Python raised for it
            problem, param = f"failed: {type(exc).__name__}: {exc}", None
        raise ChatTemplateError(f"the chat template {problem}", param)

    def prompt_ids(self, messages: list[dict[str, Any]], tokenizer: Tokenizer) -> list[int]:
        """The token ids of the prompt: the template's text as it is, or the fallback's after BOS."""
        text = self.render(messages)
        if self._template is None:
            return prompt_ids(tokenizer, text)
        ids = tokenizer.encode(text)
        if not ids:
            raise ChatTemplateError("the chat template wrote an empty prompt for this conversation",
                                    "messages")
        return ids


class _TooMuch(Exception):
    pass


def _bounded_render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """``template`` rendered, refused past MAX_RENDER_STEPS lines of its code or MAX_PROMPT_CHARS
    characters written.  Its lines are counted by a trace function on this thread, for the
    render only (a loop of loops writes nothing, and runs as long as it likes otherwise)."""
    steps = 0

    def count(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > MAX_RENDER_STEPS:
                raise _TooMuch(f"the chat template ran past {MAX_RENDER_STEPS} steps")
        return count

    def enter(frame: Any, event: str, arg: Any) -> Any:
        return count if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        out: list[str] = []
        size = 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_PROMPT_CHARS:
                raise _TooMuch(f"the chat template wrote more than {MAX_PROMPT_CHARS} characters")
            out.append(piece)
        return "".join(out)
    except _TooMuch as exc:
        raise ChatTemplateError(str(exc)) from None
    finally:
        sys.settrace(previous)


def _json_object(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or ``{"content": text, ..}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(value: Any) -> str | None:
    """``chat_template`` as written: a string, or named templates of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{CONFIG_FILE}: chat_template names {sorted(map(str, named))}, and no 'default'")
    raise ValueError(f"{CONFIG_FILE}: chat_template is neither a string nor a list of {{name, template}}")
