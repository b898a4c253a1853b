"""The tokenizer every layer shares: a `tokenizers` BPE plus the model's chat template.

Loaded from a Hugging Face style folder (tokenizer.json, and tokenizer_config.json for the
special tokens and the chat template). The stub model uses this same tokenizer, so the
detokenizer sees the same multi-byte fragments with the stub as with real weights.
"""

from __future__ import annotations

import datetime
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(
        self,
        tok: _HFTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        chat_template: str | None,
        special_tokens: Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self._tok = tok
        # tokenizer_config.json as the folder had it: what `/tokenizer_info` reports.
        self.config: dict[str, Any] = dict(config or {})
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self._special_tokens = dict(special_tokens or {})
        # The added tokens marked special, each id the vocabulary gives its text. Read once:
        # asking per vocabulary entry was quadratic (Gemma 3: 262,144 entries and 6,384
        # added tokens took minutes).
        special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
        self.special_ids = frozenset(
            i for t, i in tok.get_vocab(with_added_tokens=True).items() if t in special
        )
        self._texts: list[str] | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        tok = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
        model_cfg: dict[str, Any] = {}
        if (folder / "config.json").exists():
            model_cfg = json.loads((folder / "config.json").read_text())

        def token_id(name: str) -> int | None:
            value = cfg.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        eos = model_cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        eos_from_tok = token_id("eos_token")
        if eos_from_tok is not None and eos_from_tok not in eos_ids:
            eos_ids.append(eos_from_tok)
        bos = model_cfg.get("bos_token_id")
        if not isinstance(bos, int):
            bos = token_id("bos_token")
        template = cfg.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        specials = {
            k: (v["content"] if isinstance(v, dict) else v)
            for k, v in cfg.items()
            if k.endswith("_token") and isinstance(v, str | dict)
        }
        return cls(
            tok,
            eos_token_ids=eos_ids,
            bos_token_id=bos,
            chat_template=template,
            special_tokens=specials,
            config=cfg,
        )

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar engine builds its vocabulary
        view from)."""
        return str(self._tok.to_str())

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether `other` maps every token id to the same string (a draft model's tokens
        must mean the target's): the two vocabularies, added tokens included, are equal."""
        return (self.vocab_size == other.vocab_size
                and self._tok.get_vocab(with_added_tokens=True)
                == other._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # A batch of one, not `encode`: tokenizers' single `encode` holds the GIL for its
        # whole run, and its batch calls release it. The server tokenizes in a worker
        # thread (server/offload.py), but a thread holding the GIL stalls the event loop
        # as surely as the loop doing the work: a 1 MB prompt (200,000 tokens) held every
        # stream and /health for 420-470 ms; as a batch, the loop's worst wait is 7 ms.
        # The _fast variant leaves out the offsets, which nothing here reads: the same ids,
        # a third sooner, and no slower than `encode` on a five-character text.
        (enc,) = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(enc.ids)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's ids as vLLM and transformers make them: with the tokenizer's own
        special tokens (Gemma's and Llama's <bos>; SmolLM2's adds none). A rendered chat
        template holds its own, so chat text goes through `encode` instead."""
        return self.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """`messages` through the chat template, as ids (see encode_prompt)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_texts(self) -> list[str]:
        """Each id's text decoded alone, special tokens included: "\ufffd" where the id
        holds part of a multi-byte character (a byte-level BPE fragment, a byte-fallback
        piece). Built once, on first use (a tenth of a second for 49,152 ids)."""
        if self._texts is None:
            ids = [[i] for i in range(self.vocab_size)]
            self._texts = [str(t) for t in self._tok.decode_batch(ids, skip_special_tokens=False)]
        return self._texts

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's own string for the id (transformers' `convert_ids_to_tokens`):
        "Ġis" for a byte-level BPE token, not its decoded text " is"."""
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        now: Callable[[], float] = time.time,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render `messages` with the model's (or the given) Jinja chat template. As in
        transformers, a template may call `strftime_now(fmt)` (Llama 3.x puts today's date in
        its system header): the date of `now()`, epoch seconds, local time; the server passes
        its own clock, so a replay renders the same text on any day."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass one with --chat-template")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def strftime_now(fmt: str) -> str:
            return datetime.datetime.fromtimestamp(now()).strftime(fmt)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        env.filters["tojson"] = _tojson
        extra = {} if tools is None else {"tools": list(tools)}  # as transformers passes them
        return env.from_string(template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
            **extra,
        )

    def template_reads(self, name: str, chat_template: str | None = None) -> bool:
        """Whether the chat template (the given one, else the model's) reads the variable
        `name` at all: one that never reads `tools` cannot show the model its functions."""
        template = chat_template or self.chat_template
        return template is not None and name in _template_variables(template)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """`tojson` as chat templates are written against (transformers' filter): plain
    json.dumps, keys in their order, no HTML escaping. Jinja's own sorts the keys and
    escapes quotes and brackets, so a tool's JSON schema would read differently to the model
    than under transformers (Qwen's and Llama's templates list the tools with it)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its context, parsed once per template (each
    chat request asks whether it reads `tools`)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
