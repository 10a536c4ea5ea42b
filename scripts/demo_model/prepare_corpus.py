"""Build the demo model's English corpus from Debian packages (no model hub, no network beyond apt).

Sources (install with `apt-get install fortunes fortunes-min python3.11-doc`):
  * python3.11-doc: the reStructuredText sources of the Python 3.11 documentation,
    /usr/share/doc/python3.11/html/_sources/**/*.rst.txt (the whatsnew/changelog is left out: it
    is a list of bug numbers, not prose). Markup is reduced to plain text with a handful of regexes
    (roles, links, directives, heading underlines); code examples are kept as they are.
  * fortunes, fortunes-min: /usr/share/games/fortunes/<topic> (the %-separated text files; the
    ASCII-art and non-English files are left out).
  * Chat examples synthesized from the same text, so the chat template has something to stand on:
    "What does json.dumps do?" -> the first paragraph under `.. function:: json.dumps(...)`,
    "What is a decorator?" -> the glossary entry, "Tell me a fortune." -> a fortune. They are
    written with the Qwen chat markup (<|im_start|>role ... <|im_end|>, an empty think block).

  * With --prose, English prose from more Debian packages (prose_sources.py: the GCIDE, FOLDOC,
    Jargon File and Devil's dictionaries, the Debian Administrator's Handbook, the GNU coding
    standards), and chats asking what a word or a computing term means, answered with its
    definition. --docs-weight repeats the Python documentation (and its chats) in the training
    text, so windows drawn uniformly from it still see mostly what the held-out test measures;
    --gcide-share keeps a stable subset of the (large) GCIDE.

Held-out split: whole documents (a doc file, a fortune topic's every 40th fortune, every 40th chat,
every dictionary entry or manual page whose key hashes to 0 mod 40) go to the validation set by a
stable rule, never by chance, so the split is the same on every run.

Output (in --out, default scripts/demo_model/data/):
  train.txt, val.txt   documents separated by the line "<|endoftext|>" (chats end in <|im_end|>).
  heldout_prose.txt    a few KB of held-out Python-docs prose paragraphs (no code blocks), separated
                       by blank lines, for tests/data/demo_heldout.txt.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
from pathlib import Path

DOC_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
FORTUNE_ROOT = Path("/usr/share/games/fortunes")
FORTUNE_SKIP = {"art", "ascii-art", "translate-me"}  # pictures, not text; not English
EOT = "<|endoftext|>"

# --- reStructuredText -> plain text --------------------------------------------------------------

# Directives whose whole block (the directive line and its indented body) carries no prose.
DROP_BLOCK = {
    "index",
    "toctree",
    "moduleauthor",
    "sectionauthor",
    "highlight",
    "include",
    "literalinclude",
    "tabularcolumns",
    "currentmodule",
    "testsetup",
    "testcleanup",
    "only",
    "raw",
    "image",
    "figure",
    "productionlist",
    "csv-table",
    "program",
    "audit-event",
    "audit-event-table",
    "impl-detail",
    "availability",
    "opcode",
    "pdbcommand",
    "cmdoption",
    "option",
    "envvar",
    "describe",
}
# Directives that become a short English lead-in; their body stays.
LEAD_IN = {
    "note": "Note:",
    "warning": "Warning:",
    "seealso": "See also:",
    "important": "Important:",
    "caution": "Caution:",
    "tip": "Tip:",
    "hint": "Hint:",
    "attention": "Attention:",
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}:",
    "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {}:",
}
# Object descriptions: the signature is kept as a line of its own.
SIGNATURE = {
    "function",
    "method",
    "class",
    "data",
    "attribute",
    "exception",
    "decorator",
    "classmethod",
    "staticmethod",
    "coroutinemethod",
    "coroutinefunction",
    "abstractmethod",
    "module",
    "c:function",
    "c:member",
    "c:type",
    "c:var",
    "c:macro",
    "decoratormethod",
}

DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
COMMENT = re.compile(r"^(\s*)\.\.(\s|$)")  # ".. anything" that is not a directive
OPTION = re.compile(r"^\s+:[\w-]+:")
UNDERLINE = re.compile(r"^([=\-~^*#\"'`+.])\1{2,}\s*$")
ROLE = re.compile(r":([\w:+-]+):`([^`]*)`")
LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`__?")
SIMPLE_LINK = re.compile(r"`([^`]+)`__?")
FOOTNOTE = re.compile(r"\s*\[#[\w-]*\]_")
LITERAL = re.compile(r"``(.+?)``")
STRONG = re.compile(r"\*\*(.+?)\*\*")


def _role_text(m: re.Match) -> str:
    role, text = m.group(1), m.group(2)
    if role in ("rfc", "pep"):
        return f"{role.upper()} {text}"
    title = re.match(r"(.*?)\s*<[^>]*>$", text, re.S)
    if title and title.group(1):
        return title.group(1)
    text = text.lstrip("!")
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return text


def inline(line: str) -> str:
    line = ROLE.sub(_role_text, line)
    line = LINK.sub(r"\1", line)
    line = FOOTNOTE.sub("", line)
    line = LITERAL.sub(r"\1", line)
    line = SIMPLE_LINK.sub(r"\1", line)
    line = STRONG.sub(r"\1", line)
    line = line.replace("|version|", "3.11").replace("|release|", "3.11")
    if line.rstrip().endswith("::"):  # "Example::" introduces a literal block
        line = line.rstrip()[:-1]
    return line


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def rst_to_text(src: str) -> str:
    lines = src.expandtabs(4).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = DIRECTIVE.match(line)
        if m or COMMENT.match(line):
            ind = len((m or COMMENT.match(line)).group(1))
            name = m.group(2) if m else None
            arg = m.group(3).strip() if m else ""
            i += 1
            # Skip the directive's option lines.
            while i < len(lines) and OPTION.match(lines[i]):
                i += 1
            if name is None or name in DROP_BLOCK or name.startswith("_"):
                while i < len(lines) and (not lines[i].strip() or indent_of(lines[i]) > ind):
                    i += 1
                continue
            if name in LEAD_IN:
                text = LEAD_IN[name]
                out.append(
                    " " * ind
                    + (
                        text.format(arg.split()[0] if arg else "")
                        if "{}" in text
                        else (text + " " + inline(arg)).rstrip()
                    )
                )
            elif name in SIGNATURE:
                if arg:
                    out.append(" " * ind + inline(arg))
            elif arg:
                out.append(" " * ind + inline(arg))
            continue
        if UNDERLINE.match(line):
            i += 1
            continue
        if line.strip() == "::":
            i += 1
            continue
        out.append(inline(line).rstrip())
        i += 1
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


# --- chat examples -------------------------------------------------------------------------------


def chat(user: str, answer: str, system: str | None = None) -> str:
    parts = []
    if system:
        parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    parts.append(f"<|im_start|>user\n{user}<|im_end|>\n")
    parts.append(f"<|im_start|>assistant\n<think>\n\n</think>\n\n{answer.strip()}<|im_end|>")
    return "".join(parts)


def first_paragraph(lines: list[str], start: int, ind: int) -> str:
    """The first prose paragraph of the body that follows line `start` (indented deeper than `ind`)."""
    i = start
    while i < len(lines) and (OPTION.match(lines[i]) or not lines[i].strip()):
        i += 1
    para = []
    while i < len(lines) and lines[i].strip() and indent_of(lines[i]) > ind:
        if DIRECTIVE.match(lines[i]):
            break
        para.append(inline(lines[i].strip()))
        i += 1
    return " ".join(para)


def doc_chats(src: str) -> list[str]:
    lines = src.expandtabs(4).splitlines()
    chats = []
    for i, line in enumerate(lines):
        m = DIRECTIVE.match(line)
        if not m or m.group(2) not in {"function", "method", "class", "exception", "decorator"}:
            continue
        sig = m.group(3).strip()
        name = sig.split("(")[0].strip()
        body = first_paragraph(lines, i + 1, len(m.group(1)))
        if len(body) < 40 or not name:
            continue
        q = random.choice(
            [
                f"What does {name} do?",
                f"Explain {name}.",
                f"What is {name}?",
                f"How do I use {name}?",
                f"Tell me about {name}.",
            ]
        )
        chats.append(chat(q, f"{sig}\n\n{body}"))
    return chats


def glossary_chats(src: str) -> list[str]:
    lines = src.expandtabs(4).splitlines()
    chats = []
    for i, line in enumerate(lines):
        if indent_of(line) == 3 and line.strip() and not line.strip().startswith(".."):
            term = inline(line.strip())
            body = first_paragraph(lines, i + 1, 3)
            if len(body) > 40:
                q = random.choice(
                    [f"What is {term}?", f"What does {term} mean in Python?", f"Define {term}."]
                )
                chats.append(chat(q, body))
    return chats


FORTUNE_ASKS = [
    "Tell me a fortune.",
    "Say something wise.",
    "Give me a quote.",
    "Tell me something funny.",
    "Do you have a saying for today?",
    "Cheer me up.",
]


# --- prose from other packages (--prose) ---------------------------------------------------------

WORD_ASKS = ["What does the word {} mean?", "Define {}.", "What is the meaning of {}?"]
TERM_ASKS = ["What is {}?", "Explain {}.", "What does {} mean in computing?"]


def add_prose(train: list[str], val: list[str], train_chats: list[str], val_chats: list[str],
              gcide_share: float) -> None:
    from prose_sources import dictionary_documents, manual_documents

    sizes: dict[str, int] = {}
    for source, key, text in [*dictionary_documents(), *manual_documents()]:
        if source == "gcide" and stable_bucket("keep:" + key, 1000) >= gcide_share * 1000:
            continue
        is_val = stable_bucket(f"{source}:{key}", 40) == 0
        (val if is_val else train).append(text.strip() + "\n")
        sizes[source] = sizes.get(source, 0) + len(text)
        # A chat for one entry in 12: the question names the headword, the answer is the entry.
        if source in ("gcide", "foldoc", "jargon", "devil") and random.random() < 1 / 12:
            asks = WORD_ASKS if source in ("gcide", "devil") else TERM_ASKS
            answer = text.split("\n\n", 1)[0]
            (val_chats if is_val else train_chats).append(chat(random.choice(asks).format(key), answer))
    print("prose:", ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()))


def add_more_docs(train: list[str], val: list[str]) -> None:
    """The Sphinx pages of Debian's Python *-doc packages and the docstrings of the Python sources
    here (doc_sources.py): 1 in 40 documents to validation by a stable hash of its key, exact
    duplicates (a page shipped by two packages) kept once. drop_leaks then cleans all of train."""
    from doc_sources import dedupe, docstring_documents, sphinx_documents

    fresh = dedupe()
    sizes: dict[str, int] = {}
    for source, key, text in [*sphinx_documents(rst_to_text), *docstring_documents()]:
        if len(text) < 200 or not fresh(text):
            continue
        (val if stable_bucket(f"{source}:{key}", 40) == 0 else train).append(text.strip() + "\n")
        group = "docstrings" if source in ("stdlib", "site") else "sphinx"
        sizes[group] = sizes.get(group, 0) + len(text)
    print("more docs:", ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()))


def drop_leaks(train: list[str], heldout_texts: list[str]) -> list[str]:
    """train without the paragraphs (chats: the whole chat) that share a 13-word sequence with a
    held-out page or the test's paragraphs (doc_sources.leakage_filter)."""
    from doc_sources import leakage_filter

    clean = leakage_filter(heldout_texts)
    kept, dropped = [], 0
    for doc in train:
        text, n = clean(doc)
        dropped += n
        if n and doc.startswith("<|im_start|>"):
            continue
        if text.strip():
            kept.append(text if text.endswith("\n") else text + "\n")
    print(f"leakage filter: {dropped} paragraphs dropped for sharing 13 words with a held-out text")
    return kept


# --- main ----------------------------------------------------------------------------------------


def stable_bucket(key: str, n: int) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--prose", action="store_true", help="add the dictionaries and manuals (prose_sources.py)")
    ap.add_argument("--docs-weight", type=int, default=1, help="times the Python docs appear in train.txt")
    ap.add_argument("--more-docs", action="store_true",
                    help="add the Debian *-doc packages' Sphinx pages and Python docstrings (doc_sources.py)")
    ap.add_argument("--heldout-test", default=str(Path(__file__).parents[2] / "tests/data/demo_heldout.txt"),
                    help="the test's held-out paragraphs: no training paragraph may share a 13-word sequence with them")
    ap.add_argument("--gcide-share", type=float, default=1.0, help="fraction of GCIDE entries kept (stable)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(0)

    train, val, heldout_prose = [], [], []
    heldout_pages: list[str] = []  # the held-out doc pages' text: the leakage filter's reference
    train_chats, val_chats = [], []

    docs = sorted(p for p in DOC_ROOT.rglob("*.rst.txt") if "changelog" not in p.name)
    if not docs:
        raise SystemExit(f"no docs under {DOC_ROOT}: apt-get install python3.11-doc")
    for p in docs:
        src = p.read_text(encoding="utf-8", errors="replace")
        text = rst_to_text(src)
        if len(text) < 200:
            continue
        is_val = stable_bucket(str(p.relative_to(DOC_ROOT)), 30) == 0
        (val if is_val else train).append(text)
        chats = glossary_chats(src) if p.name == "glossary.rst.txt" else doc_chats(src)
        (val_chats if is_val else train_chats).extend(chats)
        if is_val:
            heldout_pages.append(text)
            # Prose paragraphs (no code, no indented blocks) for the test's held-out file.
            for para in text.split("\n\n"):
                if (
                    para[:1].isupper()
                    and "\n " not in para
                    and ">>>" not in para
                    and len(para) > 200
                    and para.rstrip().endswith(".")
                ):
                    heldout_prose.append(para.strip())

    files = sorted(
        p
        for p in FORTUNE_ROOT.iterdir()
        if p.is_file() and "." not in p.name and p.name not in FORTUNE_SKIP
    )
    if not files:
        raise SystemExit(f"no fortunes under {FORTUNE_ROOT}: apt-get install fortunes fortunes-min")
    n_fortunes = 0
    for p in files:
        src = p.read_text(encoding="utf-8", errors="replace").expandtabs(8)
        for k, f in enumerate(s.strip("\n") for s in re.split(r"^%$", src, flags=re.M)):
            if not f.strip() or not f.isascii():
                continue
            n_fortunes += 1
            (val if k % 40 == 7 else train).append(f.strip() + "\n")
            if random.random() < 0.15:
                (val_chats if k % 40 == 7 else train_chats).append(
                    chat(random.choice(FORTUNE_ASKS), f)
                )

    docs_train = list(train)  # the Python docs (and fortunes): what --docs-weight repeats
    if args.prose:
        add_prose(train, val, train_chats, val_chats, args.gcide_share)
    if args.more_docs:
        add_more_docs(train, val)

    # Some two-turn chats and a system prompt now and then, so both shapes are seen.
    def with_extras(chats: list[str]) -> list[str]:
        res = []
        for c in chats:
            if random.random() < 0.2:
                c = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + c
            res.append(c)
        for _ in range(len(chats) // 10):
            a, b = random.sample(chats, 2)
            if not a.startswith("<|im_start|>system") and not b.startswith("<|im_start|>system"):
                res.append(a + "\n" + b)
        return res

    train.extend(with_extras(train_chats))
    val.extend(with_extras(val_chats))
    train.extend(docs_train * (args.docs_weight - 1))
    if args.more_docs:
        train = drop_leaks(train, heldout_pages + [Path(args.heldout_test).read_text(encoding="utf-8")])
    random.shuffle(train)
    random.shuffle(val)

    sep = f"\n{EOT}\n"
    (out / "train.txt").write_text(sep.join(train) + sep, encoding="utf-8")
    (out / "val.txt").write_text(sep.join(val) + sep, encoding="utf-8")
    random.shuffle(heldout_prose)
    keep, size = [], 0
    for para in heldout_prose:
        if size > 6000:
            break
        keep.append(para)
        size += len(para)
    (out / "heldout_prose.txt").write_text("\n\n".join(keep) + "\n", encoding="utf-8")
    print(f"docs {len(docs)}  fortunes {n_fortunes}  chats {len(train_chats)}+{len(val_chats)}")
    for name in ("train.txt", "val.txt", "heldout_prose.txt"):
        print(f"{name}: {(out / name).stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
