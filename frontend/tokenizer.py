"""Tokenizers: a checkpoint's ``tokenizer.json`` (Hugging Face ``tokenizers``) with the chat
template of its ``tokenizer_config.json``, or a built-in byte-level tokenizer for the presets.

    tok = load_tokenizer("tiny")                 # a preset: ByteTokenizer
    tok = load_tokenizer("/models/qwen2-0.5b")   # tokenizer.json + tokenizer_config.json
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from kvpool.frontend.chat_template import BYTE_CHAT_TEMPLATE, render_chat
from kvpool.shared.model_config import PRESETS

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class SpecialTokens:
    bos: str | None
    eos: str | None
    bos_id: int | None
    eos_id: int | None
    add_bos: bool  # prepend bos when encoding a plain prompt (add_special_tokens)


def check_unicode(text: str) -> None:
    """A ValueError for text that is not Unicode (a lone UTF-16 surrogate, as JSON's ``\\ud800``
    decodes): what every tokenizer would otherwise fail on with its own obscure error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone UTF-16 surrogate at {e.start}: not valid Unicode") from None


class ByteTokenizer:
    """UTF-8 bytes as tokens: 0 pad, 1 eos ``</s>``, 2 bos ``<s>``, 3..258 the 256 byte values.

    Ids past 258 (a preset's vocabulary is larger; seeded weights sample them) decode to printable
    ASCII so gibberish stays readable; encode never produces them.
    """

    OFFSET = 3
    _SPECIAL = re.compile("(<s>|</s>)")

    def __init__(self, vocab_size: int = 512, name: str = "bytes") -> None:
        if vocab_size < self.OFFSET + 256:
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of >= 259 ids, the model has {vocab_size}")
        self.vocab_size, self.name = vocab_size, name
        self.special = SpecialTokens("<s>", "</s>", 2, 1, True)
        self.chat_template = BYTE_CHAT_TEMPLATE

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token can stand for (a byte each)."""
        return 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        check_unicode(text)
        ids = [2] if add_special_tokens else []
        for part in self._SPECIAL.split(text):
            if part == "<s>":
                ids.append(2)
            elif part == "</s>":
                ids.append(1)
            else:
                ids.extend(b + self.OFFSET for b in part.encode("utf-8"))
        return ids

    def token_bytes(self, token: int, skip_special_tokens: bool = True) -> bytes:
        if token < self.OFFSET:
            return b"" if skip_special_tokens else (b"<pad>", b"</s>", b"<s>")[token]
        if token < self.OFFSET + 256:
            return bytes((token - self.OFFSET,))
        return bytes((0x21 + (token - self.OFFSET - 256) % 94,))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(t, skip_special_tokens) for t in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def _token_text(value: object) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken map."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: object) -> str | None:
    """``chat_template`` is a string, or a list of {name, template} (the "default" one is used)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A checkpoint directory's tokenizer.json, special tokens and chat template."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"{path} has no tokenizer.json: the front door needs the checkpoint's "
                             "tokenizer (save it with tokenizer.save_pretrained(path))")
        self.name = os.path.basename(os.path.normpath(path))
        self.tok = Tokenizer.from_file(file)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # a bound on the text one token stands for: its vocabulary string's UTF-8 bytes (a
        # byte-level BPE writes a byte as one 1-2 byte character, so this is at most 2x loose)
        self.max_token_bytes = max((len(t.encode("utf-8")) for t in self.tok.get_vocab(with_added_tokens=True)),
                                   default=1)
        config = self._read_json(os.path.join(path, "tokenizer_config.json"))
        self.specials = {k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        template = _pick_template(config.get("chat_template"))
        jinja = os.path.join(path, "chat_template.jinja")  # newer checkpoints keep it beside
        if template is None and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        self.chat_template = template
        bos, eos = self.specials.get("bos_token"), self.specials.get("eos_token")
        self.special = SpecialTokens(bos, eos, self.tok.token_to_id(bos) if bos else None,
                                     self.tok.token_to_id(eos) if eos else None,
                                     bool(config.get("add_bos_token", False)))

    @staticmethod
    def _read_json(file: str) -> dict:
        if not os.path.isfile(file):
            return {}
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        check_unicode(text)
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.special.bos_id
        if add_special_tokens and self.special.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError(f"the tokenizer of {self.name} has no chat template: use /v1/completions, "
                             "or add chat_template to its tokenizer_config.json")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.specials)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a preset (built-in bytes) or of a checkpoint directory."""
    if model in PRESETS:
        return ByteTokenizer(PRESETS[model].vocab_size, name=model)
    if os.path.isdir(model):
        return HFTokenizer(model)
    raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
