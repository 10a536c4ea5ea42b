"""How much of the held-out text the training text repeats: the share of the held-out text's
13-word sequences (lower-cased words, punctuation ignored) that occur anywhere in the training text.

  python leakage.py data/train.txt ../../tests/data/demo_heldout.txt [more held-out files]

0 means no 13 consecutive words of a held-out file were trained on. prepare_corpus.py --more-docs
drops the paragraphs that would make it non-zero (doc_sources.leakage_filter); this check reads the
files it wrote, so it proves the filter rather than trusting it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from doc_sources import NGRAM, word_ngrams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("train")
    ap.add_argument("heldout", nargs="+")
    args = ap.parse_args()
    held = {f: word_ngrams(Path(f).read_text(encoding="utf-8")) for f in args.heldout}
    wanted = set().union(*held.values())
    found: set[tuple[str, ...]] = set()
    window: list[str] = []
    n_words = 0
    with open(args.train, encoding="utf-8") as fh:
        for line in fh:  # streamed: the training text is ~100 MB
            for w in re.findall(r"\w+", line.lower()):
                n_words += 1
                window.append(w)
                if len(window) > NGRAM:
                    del window[0]
                if len(window) == NGRAM and (t := tuple(window)) in wanted:
                    found.add(t)
    print(f"training text: {n_words} words")
    for f, grams in held.items():
        hit = len(grams & found)
        print(f"{f}: {hit} of its {len(grams)} {NGRAM}-word sequences occur in the training text "
              f"({100 * hit / max(1, len(grams)):.2f}%)")


if __name__ == "__main__":
    main()
