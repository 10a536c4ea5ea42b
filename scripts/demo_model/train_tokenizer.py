"""Train the demo model's byte-level BPE tokenizer and tokenize the corpus.

Shaped like Qwen's tokenizer so lily's tokenizer path is exercised the same way:
  * NFC normalizer, a Split pre-tokenizer with the Qwen2 regex (contractions, letters, single
    digits, punctuation runs, newlines), then byte-level mapping without prefix space; byte-level
    decoder.
  * BPE ranks first (4096 - 9 of them), then the added tokens, like Qwen puts its 33 specials after
    its 248,044 ranks: <|endoftext|>, <|im_start|>, <|im_end|> (special: skipped when decoding
    with skip_special_tokens) and <think>, </think>, <tool_call>, </tool_call>, <tool_response>,
    </tool_response> (added, not special: they decode as text, as in Qwen).
The documents in train.txt/val.txt are separated by "\n<|endoftext|>\n"; each document is encoded
on its own and followed by the <|endoftext|> id, so the separator newlines never become tokens.

Writes to --out (default scripts/demo_model/data/): tokenizer.json, train.bin, val.bin (uint16).

--reuse TOKENIZER_JSON encodes with an existing tokenizer instead of training one (the shipped
demo's, say: then token ids, vocabulary and per-token perplexities stay comparable with the
model it replaces, and tests keyed on its ids keep their meaning).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer

VOCAB_SIZE = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EOT = "<|endoftext|>"


def documents(path: Path) -> list[str]:
    return [d for d in path.read_text(encoding="utf-8").split(f"\n{EOT}\n") if d]


def build(train_docs: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL) + len(ADDED)

    # The chat markup must not leak into BPE merges: train on the text with the markup tokens cut
    # out (they are added whole afterwards).
    def plain(docs):
        for d in docs:
            for t in SPECIAL + ADDED:
                d = d.replace(t, "\n")
            yield d

    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(plain(train_docs), trainer=trainer, length=len(train_docs))
    assert tok.get_vocab_size() == VOCAB_SIZE - n_added, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def encode(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--reuse", default=None, help="an existing tokenizer.json to encode with (no training)")
    args = ap.parse_args()
    data = Path(args.data)
    train_docs, val_docs = documents(data / "train.txt"), documents(data / "val.txt")
    if args.reuse:
        tok = Tokenizer.from_file(args.reuse)
        assert tok.get_vocab_size() == VOCAB_SIZE
        assert [tok.token_to_id(t) for t in SPECIAL + ADDED] == list(range(VOCAB_SIZE - 9, VOCAB_SIZE))
    else:
        tok = build(train_docs)
    tok.save(str(data / "tokenizer.json"))
    for name, docs in (("train", train_docs), ("val", val_docs)):
        ids = encode(tok, docs)
        ids.tofile(data / f"{name}.bin")
        chars = sum(len(d) for d in docs)
        print(f"{name}: {len(docs)} docs, {ids.size} tokens, {chars / ids.size:.2f} chars/token")
    # Round trip: decoding must give the text back (byte-level BPE is lossless after NFC).
    sample = val_docs[0]
    assert tok.decode(tok.encode(sample).ids, skip_special_tokens=False) == sample
    print("ids:", {t: tok.token_to_id(t) for t in SPECIAL + ADDED})


if __name__ == "__main__":
    main()
