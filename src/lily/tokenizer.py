"""The checkpoint's tokenizer, and incremental detokenization for streaming.

`Tokenizer` wraps the Hugging Face `tokenizers` library on the checkpoint's `tokenizer.json`;
`tokenizer_config.json` names the special tokens (eos, pad, bos) and may carry the chat
template; `generation_config.json` / `config.json` may add more end-of-sequence ids (Qwen3.5
lists both `<|im_end|>` and `<|endoftext|>`), so `eos_token_ids` is the union of all three.

Encoding never adds BOS/EOS (Qwen has none; chat templates write every control token) but
does recognise added tokens written in the text, as transformers' `apply_chat_template` does.

`IncrementalDetokenizer` turns a token stream into text deltas. Byte-level BPE splits a
multi-byte UTF-8 character across tokens, so decoding token by token would emit U+FFFD halves.
It keeps a small window (the tokens since the last emitted boundary) and emits only when the
window's decoded text has grown and does not end in U+FFFD, the approach of vLLM's and
transformers' streamers. The concatenated deltas (plus `flush()`) equal `decode(all ids)`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from lily._core import RequestError

__all__ = ["Tokenizer", "IncrementalDetokenizer", "load_json_file"]


def load_json_file(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as "text" or {"content": "text", ...}.
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unexpected special-token entry {value!r} in tokenizer_config.json")


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


class Tokenizer:
    """Encode / decode with a checkpoint's `tokenizer.json`.

    Build with `Tokenizer.from_dir(checkpoint_dir)`; `Tokenizer(tokenizer_json, config)` takes
    the file and an already-parsed tokenizer_config dict.
    """

    def __init__(
        self,
        tokenizer_json: str | os.PathLike,
        config: dict | None = None,
        *,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ):
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from e
        self.config = dict(config or {})
        self.path = path

        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.unk_token = _token_text(self.config.get("unk_token"))
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = getattr(self, name)
            if text is not None and self._tok.token_to_id(text) is None:
                raise ValueError(f"tokenizer_config.json {name} {text!r} is not in {path.name}")

        eos = [] if self.eos_token is None else [self._tok.token_to_id(self.eos_token)]
        for i in extra_eos_token_ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"eos token id {i} is outside the vocabulary ({self.vocab_size})")
            if i not in eos:
                eos.append(i)
        self.eos_token_ids: list[int] = eos

        template = chat_template if chat_template is not None else self.config.get("chat_template")
        if isinstance(template, list):  # the named-templates form: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template

        added = self._tok.get_added_tokens_decoder()  # id -> AddedToken
        self.added_tokens: dict[str, int] = {t.content: i for i, t in sorted(added.items())}
        self.all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json
        and config.json for extra EOS ids) from a checkpoint folder."""
        root = Path(path)
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{root}: no tokenizer.json (lily needs the fast-tokenizer file)")
        config = load_json_file(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (root / name).is_file():
                data = load_json_file(root / name)
                # Multimodal configs nest the text model's fields.
                value = data.get("eos_token_id", (data.get("text_config") or {}).get("eos_token_id"))
                extra += _ids(value)
        template = None
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tj, config, extra_eos_token_ids=extra, chat_template=template)

    # ------------------------------------------------------------------------- basic

    @property
    def vocab_size(self) -> int:
        """Ids in use, including added tokens (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self._tok.token_to_id(self.pad_token)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # The tokenizers library refuses text that is not valid Unicode (a lone surrogate,
            # which JSON's \ud800 escapes can produce) with a bare TypeError; found by the
            # server fuzz target. Name the character; the server answers 400 for RequestError.
            bad = next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) < 0xE000), None)
            if bad is None:
                raise
            raise RequestError(
                f"[tokenizer] the text has an unpaired surrogate U+{ord(text[bad]):04X} at index {bad}; "
                "it is not valid Unicode"
            ) from None

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary ({self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, *, tokenize: bool = True, **kwargs):
        """Render `messages` with this checkpoint's template (see lily.chat_template.render);
        returns token ids, or the text with tokenize=False."""
        from lily.chat_template import render

        if self.chat_template is None:
            raise ValueError(f"{self.path.parent}: the checkpoint has no chat template")
        specials = {
            k: v
            for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                         ("pad_token", self.pad_token), ("unk_token", self.unk_token))
            if v is not None
        }
        text = render(self.chat_template, messages, **{**specials, **kwargs})
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, eos_token_ids={self.eos_token_ids})"


class IncrementalDetokenizer:
    """Feed token ids one at a time; get text deltas that never split a character.

        detok = tokenizer.detokenizer()
        for t in tokens: print(detok.feed(t), end="")
        print(detok.flush())
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are fully emitted
        self._read = 0  # tokens in [prefix, read) are emitted as text already
        self.text = ""  # everything emitted so far

    def _decode(self, a: int, b: int) -> str:
        return self._tokenizer.decode(self.ids[a:b], skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        emitted = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix, len(self.ids))
        if len(window) > len(emitted) and not window.endswith("\ufffd"):
            delta = window[len(emitted):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """The held-back tail at the end of generation (an incomplete character decodes as
        U+FFFD here, exactly as `decode` of all the ids does)."""
        emitted = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix, len(self.ids))
        delta = window[len(emitted):] if window.startswith(emitted) else ""
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
