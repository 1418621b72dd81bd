"""Text <-> token ids.

Byte-level by default: byte b is id ``offset + b``, plus BOS/EOS specials.
A random checkpoint names its layout in ``byte_tokenizer.json``.  A real
checkpoint's ``tokenizer.json`` is used through the ``tokenizers`` package
(an optional dependency) when present.

A prompt's ids (``encode_prompt``) are what Hugging Face's ``tokenizer(text)``
gives: the tokenizer's post-processor adds BOS where the model wants one
(Llama 2 and 3 do, Qwen2 does not), and ``tokenizer_config.json``'s
``add_bos_token``, when set, has the last word.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

BYTE_SPEC_FILE = "byte_tokenizer.json"
HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"


class TokenizerError(Exception):
    """A tokenizer we cannot load."""


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...  # no special tokens

    def encode_prompt(self, text: str) -> list[int]: ...  # with BOS where the model wants it

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids ``offset .. offset + 255``; other ids decode as ``<id>``."""

    def __init__(self, offset: int = 0, bos_token_id: int | None = 256,
                 eos_token_ids: tuple[int, ...] = (257,)):
        self.offset = offset
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._specials = {t for t in (bos_token_id, *self.eos_token_ids) if t is not None}

    def encode(self, text: str) -> list[int]:
        return [self.offset + b for b in text.encode("utf-8")]

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.encode(text)
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for t in ids:
            b = t - self.offset
            if 0 <= b < 256 and t not in self._specials:
                run.append(b)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if t not in self._specials:
                out.append(f"<{t}>")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: Path, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 add_bos_token: bool | None = None):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise TokenizerError(f"{path} needs the tokenizers package (pip install tokenizers)") from None
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise TokenizerError(f"{path}: cannot load: {exc}") from exc
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token

    def _encode(self, text: str, specials: bool) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode does not): a long prompt
        # tokenised in a worker thread leaves the event loop running.
        return list(self._tok.encode_batch([text], add_special_tokens=specials)[0].ids)

    def encode(self, text: str) -> list[int]:
        return self._encode(text, False)

    def encode_prompt(self, text: str) -> list[int]:
        if self.add_bos_token is False:
            return self.encode(text)
        ids = self._encode(text, True)
        bos = self.bos_token_id
        if self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class IncrementalText:
    """``decode(tokens)`` of a growing list of tokens, each new token's text found by decoding
    from the token before the last text it settled (as vLLM's and TGI's detokenizers do), not
    by decoding the whole list again: decoding a long stream costs time in its length, not in
    its square.  ``text`` holds whole characters only: one whose bytes are not all here yet
    waits for the tokens that finish it."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode  # a tokenizer's
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # decode from _prefix; _read: where the settled text ends

    def add(self, token: int) -> str:
        """Take the next token; returns the text it settles ("" while a character waits)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        if after.startswith(before):
            new = after[len(before):]
            self.text += new
        else:  # the new token changed text already settled: decode it all once, and go on from here
            whole = self._decode(self.tokens)
            new = whole[len(self.text):] if whole.startswith(self.text) else ""
            self.text = whole
        self._prefix, self._read = self._read, len(self.tokens)
        return new


def tokenizer_config(model_dir: str | Path) -> dict:
    """``tokenizer_config.json`` as a dict, {} when there is none."""
    path = Path(model_dir) / HF_CONFIG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, bad JSON
        raise TokenizerError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return raw


def write_byte_tokenizer_spec(model_dir: str | Path, *, offset: int, bos_token_id: int | None,
                              eos_token_id: int | None) -> None:
    spec = {"type": "byte", "offset": offset, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    (Path(model_dir) / BYTE_SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")


def load_tokenizer(model_dir: str | Path, bos_token_id: int | None = None,
                   eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The checkpoint's tokenizer: tokenizer.json, else byte_tokenizer.json, else plain bytes.

    ``bos_token_id``/``eos_token_ids`` come from config.json.  Plain bytes
    (no file) start at 0, or just above the specials when they fall among
    the first 256 ids (Llama's layout: byte ids from 3).
    """
    model_dir = Path(model_dir)
    if (model_dir / HF_FILE).exists():
        add_bos = tokenizer_config(model_dir).get("add_bos_token")
        return HFTokenizer(model_dir / HF_FILE, bos_token_id, eos_token_ids,
                           add_bos if isinstance(add_bos, bool) else None)
    spec_path = model_dir / BYTE_SPEC_FILE
    if spec_path.exists():
        bos, eos, offset = _byte_spec(spec_path, bos_token_id)
        return ByteTokenizer(offset, bos, (eos,) if eos is not None else tuple(eos_token_ids))
    specials = [t for t in (bos_token_id, *eos_token_ids) if t is not None]
    low = [t for t in specials if t < 256]
    return ByteTokenizer(max(low) + 1 if low else 0, bos_token_id, tuple(eos_token_ids))


def _byte_spec(path: Path, bos_token_id: int | None) -> tuple[int | None, int | None, int]:
    """``byte_tokenizer.json``'s (bos, eos, offset), every field checked."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, bad JSON
        raise TokenizerError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(spec, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    if spec.get("type") != "byte":
        raise TokenizerError(f"{path}: field type: unknown type {spec.get('type')!r} (expected \"byte\")")
    if "offset" not in spec:
        raise TokenizerError(f"{path}: field offset: missing")
    offset = spec["offset"]
    if not _token_id(offset):
        raise TokenizerError(f"{path}: field offset: {offset!r} is not a non-negative integer")
    bos = spec.get("bos_token_id", bos_token_id)
    eos = spec.get("eos_token_id")
    for name, value in (("bos_token_id", bos), ("eos_token_id", eos)):
        if value is not None and not _token_id(value):
            raise TokenizerError(f"{path}: field {name}: {value!r} is not a token id (a non-negative "
                                 f"integer, or null)")
    return bos, eos, offset


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
