"""English prose from Debian packages, for the demo model's corpus (prepare_corpus.py --prose).

Each reader yields (key, text) documents; the key decides the held-out split (stable, by hash).

  dictionaries (dictd databases, /usr/share/dictd/NAME.{index,dict.dz}):
    dict-gcide    the GNU Collaborative International Dictionary of English (Webster's 1913 plus
                  later additions): definitions with literary quotations
    dict-foldoc   the Free On-line Dictionary of Computing
    dict-jargon   the Jargon File
    dict-devil    Ambrose Bierce's "The Devil's Dictionary"
  manuals:
    debian-handbook   The Debian Administrator's Handbook, en-US HTML, paragraphs only
    gnu-standards     the GNU Coding Standards and "Information for Maintainers of GNU Software"
                      (the plain-text renderings the package ships)

  apt-get install dict-gcide dict-foldoc dict-jargon dict-devil debian-handbook gnu-standards

Dictionary markup is reduced to plain English: a headword line "Word (n.):" followed by the
definitions; pronunciation keys (\\Ab*di*ca"tion\\), source tags ([1913 Webster], [PJC]),
cross-reference braces ({Flower} -> Flower), FOLDOC's dates and bare URLs are dropped.
"""

from __future__ import annotations

import gzip
import html
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

DICTD = Path("/usr/share/dictd")
HANDBOOK = Path("/usr/share/doc/debian-handbook/html/en-US")
GNU_STANDARDS = Path("/usr/share/doc/gnu-standards")
DICTIONARIES = ("gcide", "foldoc", "jargon", "devil")
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(s: str) -> int:
    """dictd's index numbers: base 64, most significant digit first."""
    n = 0
    for c in s:
        n = n * 64 + _B64.index(c)
    return n


def dictd_entries(name: str) -> Iterator[tuple[str, str]]:
    """(headword, raw entry) of a dictd database, each entry once (several headwords may point
    at one entry: the first one names it)."""
    data = gzip.open(DICTD / f"{name}.dict.dz").read()  # dictzip is gzip-compatible
    seen: set[tuple[int, int]] = set()
    for line in (DICTD / f"{name}.index").read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00"):  # 00-database-info and friends
            continue
        span = (_b64(parts[1]), _b64(parts[2]))
        if span in seen:
            continue
        seen.add(span)
        yield parts[0], data[span[0] : span[0] + span[1]].decode("utf-8", errors="replace")


PRONUNCIATION = re.compile(r"\\[^\\\n]*\\,?")
SOURCE_TAG = re.compile(r"\s*\[(?:1913 Webster|PJC|WordNet [\d.]+|Century Dict\.|Webster 1913 Suppl\.|"
                        r"Chambers 1881|RDH|Accent!|MW10|Canadian Oxford Dict\.)[^\]]*\]")
BRACES = re.compile(r"\{([^{}]*)\}")
FOLDOC_DATE = re.compile(r"^\s*\(\d{4}-\d{2}-\d{2}\)\s*$", re.M)
URL = re.compile(r"\(?<?(?:https?|ftp)://\S+>?\)?\.?")
ETYMOLOGY = re.compile(r"^\s*\[[^\]]*\]\s*", re.S)
POS = re.compile(r"^\s*(n|v\. t|v\. i|v|a|adj|adv|prep|conj|interj|pron|p\. p|p\. a|imp)\.(?:;[^.\n]*\.)?")


def _dedent(text: str) -> str:
    lines = text.splitlines()
    width = min((len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()), default=0)
    return "\n".join(ln[width:].rstrip() for ln in lines)


def _tidy(text: str) -> str:
    text = BRACES.sub(r"\1", BRACES.sub(r"\1", text))  # nested once at most
    text = URL.sub("", text)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def gcide_text(head: str, raw: str) -> str | None:
    """'Word (n.): definition...' from a GCIDE entry, or None for entries with no prose."""
    body = SOURCE_TAG.sub("", raw)
    first, _, rest = body.partition("\n")
    word = first.split("\\", 1)[0].strip().rstrip(",") or head
    after = first.split("\\", 2)[2] if first.count("\\") >= 2 else ""
    after = after.lstrip(", ")
    pos = POS.match(after)
    tail = (after[pos.end():] if pos else after).strip()
    # The etymology in brackets may run over several lines: drop it from the joined text.
    text = ETYMOLOGY.sub("", (tail + "\n" + _dedent(rest)) if tail else _dedent(rest))
    text = PRONUNCIATION.sub("", _tidy(text))
    if len(text) < 20:
        return None
    label = f" ({pos.group(0).strip()})" if pos else ""
    return f"{word}{label}: {text}"


def foldoc_text(head: str, raw: str) -> str | None:
    text = FOLDOC_DATE.sub("", raw)
    text = re.sub(r"<([a-z][\w ,-]*)>", r"(\1)", text)  # <programming> -> (programming)
    lines = _dedent(text).splitlines()
    title = lines[0].strip() if lines else head
    body = _tidy("\n".join(lines[1:]))
    if len(body) < 20 or body.startswith("See "):  # a bare cross-reference
        return None
    return f"{title}: {body}"


def plain_entry(head: str, raw: str) -> str | None:
    text = _tidy(_dedent(raw))
    return text if len(text) > 40 else None


CLEANERS = {"gcide": gcide_text, "foldoc": foldoc_text, "jargon": plain_entry, "devil": plain_entry}


def dictionary_documents() -> Iterator[tuple[str, str, str]]:
    """(source, headword, text) for every usable entry of the four dictionaries."""
    for name in DICTIONARIES:
        if not (DICTD / f"{name}.index").is_file():
            raise SystemExit(f"no {name} dictionary under {DICTD}: apt-get install dict-{name}")
        for head, raw in dictd_entries(name):
            text = CLEANERS[name](head, raw)
            if text:
                yield name, head, text


class _Paragraphs(HTMLParser):
    """The text of DocBook's paragraph elements (<div class="para">): the handbook's prose,
    without its navigation, tables of contents and titles."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.divs = 0  # open <div>s since the paragraph began (0: not in a paragraph)
        self.current: list[str] = []
        self.paragraphs: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag != "div":
            return
        if self.divs:
            self.divs += 1
        elif "para" in (dict(attrs).get("class") or "").split():
            self.divs, self.current = 1, []

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self.divs:
            self.divs -= 1
            if self.divs == 0:
                text = re.sub(r"\s+", " ", "".join(self.current)).strip()
                if len(text) > 30:
                    self.paragraphs.append(text)

    def handle_data(self, data: str) -> None:
        if self.divs:
            self.current.append(data)


def manual_documents() -> Iterator[tuple[str, str, str]]:
    """(source, file name, text): each Debian Handbook page, and the two GNU manuals."""
    if not HANDBOOK.is_dir():
        raise SystemExit(f"no {HANDBOOK}: apt-get install debian-handbook")
    for page in sorted(HANDBOOK.glob("*.html")):
        parser = _Paragraphs()
        parser.feed(page.read_text(encoding="utf-8", errors="replace"))
        text = "\n\n".join(html.unescape(p) for p in parser.paragraphs)
        if len(text) > 200:
            yield "handbook", page.name, text
    for name in ("standards", "maintain"):
        path = GNU_STANDARDS / f"{name}.text.gz"
        if not path.is_file():
            raise SystemExit(f"no {path}: apt-get install gnu-standards")
        text = gzip.open(path, "rt", encoding="utf-8", errors="replace").read()
        # One document per chapter ("1 About the GNU Coding Standards" ... "*****" underlines).
        for k, chapter in enumerate(re.split(r"\n(?=\d+ [A-Z].*\n\*{4,})", text)):
            chapter = re.sub(r"^[*=-]{4,}$", "", chapter, flags=re.M).strip()
            if len(chapter) > 200:
                yield "gnu", f"{name}-{k}", chapter
