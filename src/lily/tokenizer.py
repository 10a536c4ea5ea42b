"""The checkpoint's tokenizer, and incremental detokenization for streaming.

`Tokenizer` wraps the Hugging Face `tokenizers` library on the checkpoint's `tokenizer.json`;
`tokenizer_config.json` names the special tokens (eos, pad, bos) and may carry the chat
template; `generation_config.json` / `config.json` may add more end-of-sequence ids (Qwen3.5
lists both `<|im_end|>` and `<|endoftext|>`), so `eos_token_ids` is the union of all three.

Encoding never adds BOS/EOS (Qwen has none; chat templates write every control token) but
does recognise added tokens written in the text, as transformers' `apply_chat_template` does.

Long texts: `encode` runs in the `tokenizers` library with the GIL released (its batch call
does; the single-text call holds it), so a long prompt tokenized on one thread does not stall
the others. With `max_tokens` it also stops early once a text is known to hold more tokens:
first by a bound from its size alone (`min_tokens`: no token of the vocabulary covers more than
a known number of bytes), then by tokenizing it in pieces and stopping once they add up past the
limit (see `_PIECE_CHARS`).

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
from lily.files import check_regular, read_json, read_text

__all__ = ["Tokenizer", "IncrementalDetokenizer", "PromptTooLong", "load_json_file"]

# Tokenizing in pieces (only for texts far longer than the limit allows, so short prompts are
# tokenized once): pieces of this many characters, cut at whitespace where there is some, where
# byte-level BPE pre-tokenizers split anyway. A cut can still change the tokens next to it (the
# word it falls in); counting _CUT_SLACK tokens off per cut keeps the sum a lower bound (a
# property test checks it), so a prompt is refused only when it surely does not fit.
_PIECE_CHARS = 1 << 18
_CUT_SLACK = 64
# Unicode normalization can shrink text before it is tokenized: composing a Hangul syllable
# from its three jamo takes 9 UTF-8 bytes to 3. The size bound divides by this much more.
_NORMALIZATION_SHRINK = 4


class PromptTooLong(RequestError):
    """`encode(text, max_tokens=N)`: the text holds more than N tokens (at least `at_least`)."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"[tokenizer] the text has at least {at_least} tokens, more than {limit}")
        self.at_least, self.limit = at_least, limit


def load_json_file(path: Path) -> dict:
    data = read_json(path, ValueError)
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
        if not os.path.lexists(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        check_regular(path, ValueError)  # (the tokenizers library would block on a FIFO)
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
        if not os.path.lexists(tj):
            raise FileNotFoundError(f"{root}: no tokenizer.json (lily needs the fast-tokenizer file)")
        config = load_json_file(root / "tokenizer_config.json") if os.path.lexists(root / "tokenizer_config.json") else {}
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if os.path.lexists(root / name):
                data = load_json_file(root / name)
                # Multimodal configs nest the text model's fields.
                value = data.get("eos_token_id", (data.get("text_config") or {}).get("eos_token_id"))
                extra += _ids(value)
        template = None
        if os.path.lexists(root / "chat_template.jinja"):
            template = read_text(root / "chat_template.jinja", ValueError)
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

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what constrained-decoding libraries index)."""
        return self._tok.to_str()

    def token_bytes(self) -> list[bytes] | None:
        """Each id's bytes, for a byte-level BPE tokenizer (Qwen's, GPT-2's): a vocabulary token
        spells its bytes one character each through GPT-2's byte-to-character table; an added
        token is its text. None for any other kind (or ids without a token): callers then index
        ``to_json()``. Computed once (a second for 248K tokens)."""
        if not hasattr(self, "_token_bytes"):
            self._token_bytes = self._byte_level_tokens()
        return self._token_bytes

    def _byte_level_tokens(self) -> list[bytes] | None:
        from tokenizers import decoders, models

        if not isinstance(self._tok.model, models.BPE) or not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        added = self._tok.get_added_tokens_decoder()
        out: list[bytes | None] = [None] * self.vocab_size
        try:
            for text, i in self._tok.get_vocab(with_added_tokens=True).items():
                out[i] = text.encode("utf-8") if i in added else text.translate(_BYTE_OF_CHAR).encode("latin-1")
        except UnicodeEncodeError:  # a character outside the byte table: not a byte-level vocabulary after all
            return None
        return None if any(t is None for t in out) else out  # type: ignore[return-value]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text`` (the GIL is released while the tokenizer runs). With
        ``max_tokens``, raises PromptTooLong as soon as the text is known to hold more, often
        without tokenizing all of it."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        try:
            if max_tokens is not None:
                self._check_fits(text, max_tokens, add_special_tokens)
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
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
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLong(len(ids), max_tokens)
        return ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` from the text's size alone (0 when this
        tokenizer allows none: a model that can cover any length with one unknown token)."""
        per_token = self._max_token_bytes()
        if not per_token or not text:
            return 0
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        return -(-n_bytes // (per_token * _NORMALIZATION_SHRINK))

    def _check_fits(self, text: str, limit: int, add_special_tokens: bool) -> None:
        bound = self.min_tokens(text)
        if bound > limit:
            raise PromptTooLong(bound, limit)
        # Far longer than `limit` tokens usually take: count in pieces, stop once past it.
        if len(text) > max(_PIECE_CHARS, 16 * limit):
            bound = self._min_tokens_by_pieces(text, limit, add_special_tokens)
            if bound > limit:
                raise PromptTooLong(bound, limit)

    def _min_tokens_by_pieces(self, text: str, stop_above: int, add_special_tokens: bool = False) -> int:
        """A lower bound on len(encode(text)) from tokenizing pieces of _PIECE_CHARS characters
        (cut at a space where one is near), less _CUT_SLACK per cut; stops as soon as the bound
        passes ``stop_above``."""
        total, cuts, start = 0, 0, 0
        while start < len(text):
            end = min(start + _PIECE_CHARS, len(text))
            if end < len(text):
                space = text.rfind(" ", start + _PIECE_CHARS // 2, end)
                end = space if space > start else end
            total += len(self._tok.encode_batch([text[start:end]], add_special_tokens=add_special_tokens)[0].ids)
            cuts += start > 0
            if total - cuts * _CUT_SLACK > stop_above:
                break
            start = end
        return total - cuts * _CUT_SLACK

    def _max_token_bytes(self) -> int | None:
        """The most bytes of text one token covers, or None if unbounded; computed once from
        the tokenizer's description (byte-level BPE: one character of a token is one byte)."""
        if not hasattr(self, "_per_token"):
            self._per_token = _max_token_bytes(json.loads(self._tok.to_str()))
        return self._per_token

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False, errors: str = "strict") -> str:
        """Text of ``ids``. An id outside the vocabulary raises ValueError, or with
        ``errors="replace"`` decodes as U+FFFD (an embedding can have rows past the tokenizer's
        entries: Qwen3.5/3.6 have 248,320 rows for 248,077 tokens)."""
        ids = [int(i) for i in ids]
        n = self.vocab_size
        if any(not 0 <= i < n for i in ids):
            if errors != "replace":
                bad = next(i for i in ids if not 0 <= i < n)
                raise ValueError(f"token id {bad} is outside the vocabulary ({n})")
            out, run = [], []
            for i in ids:
                if 0 <= i < n:
                    run.append(i)
                    continue
                out.append(self._tok.decode(run, skip_special_tokens=skip_special_tokens) if run else "")
                out.append("\ufffd")
                run = []
            out.append(self._tok.decode(run, skip_special_tokens=skip_special_tokens) if run else "")
            return "".join(out)
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


def _byte_of_char() -> dict[int, str]:
    """str.translate's table undoing GPT-2's byte-to-character map of byte-level BPE (the
    `tokenizers` ByteLevel pre-tokenizer's): printable Latin-1 bytes stand for themselves, the
    other 68 for the characters from U+0100 on, in byte order. Each character becomes the
    Latin-1 character of its byte; the characters below U+0144 that spell no byte become one that
    Latin-1 cannot encode (characters above it are left, and cannot either)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    table = {c: "\U0010ffff" for c in range(256 + len(others))}
    table.update({b: chr(b) for b in kept})
    table.update({256 + n: chr(b) for n, b in enumerate(others)})
    return table


_BYTE_OF_CHAR = _byte_of_char()


def _max_token_bytes(desc: dict) -> int | None:
    """From a parsed tokenizer.json: the most bytes of (normalized) text one token stands for,
    or None when no bound holds: a non-BPE model (WordPiece maps a whole long word to [UNK]), or
    BPE fusing runs of unknown characters into one unknown token."""
    model = desc.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")
                                      and not model.get("byte_fallback")):
        return None
    normalizer = desc.get("normalizer")
    kinds = [n.get("type") for n in (normalizer.get("normalizers", [normalizer]) if normalizer else [])]
    if any(k not in ("NFC", "NFD", "NFKC", "NFKD") for k in kinds):
        return None  # a Replace or Strip normalizer could shrink the text by any amount

    def is_byte_level(part) -> bool:
        parts = part.get("pretokenizers", [part]) if isinstance(part, dict) else []
        return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)

    byte_level = is_byte_level(desc.get("pre_tokenizer")) or is_byte_level(desc.get("decoder"))
    # Byte-level vocabularies spell each byte as one character; otherwise a token's UTF-8 length
    # is at least the text it covers (Metaspace's 3-byte "\u2581" stands for one space).
    size = (lambda t: len(t)) if byte_level else (lambda t: len(t.encode("utf-8")))
    longest = max((size(t) for t in (model.get("vocab") or {})), default=1)
    for t in desc.get("added_tokens") or []:
        longest = max(longest, len(str(t.get("content", "")).encode("utf-8")))
    return max(longest, 1)


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

    @property
    def vocab_size(self) -> int:
        """Ids this detokenizer can decode (the sampler chooses no others)."""
        return self._tokenizer.vocab_size

    def _decode(self, a: int, b: int) -> str:
        # Fail safe: an id the tokenizer lacks (a padding row of the embedding) reads as U+FFFD
        # instead of ending the generation with an error.
        return self._tokenizer.decode(self.ids[a:b], skip_special_tokens=self._skip, errors="replace")

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
