"""More Python and technical documentation in English, for the demo model's corpus
(prepare_corpus.py --more-docs).

The held-out test paragraphs (tests/data/demo_heldout.txt) are prose from held-out pages of the
Python documentation, so what helps the model on them is more text of that kind: documentation
of Python libraries, written by their authors, in the same reStructuredText/Sphinx style.

  sphinx_documents()   the Sphinx sources (`_sources/**/*.txt`) that Debian's `*-doc` packages of
                       Python libraries install under /usr/share/doc (Django, SQLAlchemy, pandas,
                       SciPy, Sphinx, pytest, Celery, ...), markup reduced by prepare_corpus's
                       rst_to_text; packages that ship only HTML give the text of their pages.
  docstring_documents() the docstrings of Python sources on this machine (the standard library
                       of the Python that runs this script, and its site-packages), one document
                       per module: the module docstring, then each documented class and function
                       as its signature line with the docstring indented below it, the way the
                       Python docs lay out `.. function::` entries.

Neither source may repeat the held-out pages: the standard library modules those pages document
(logging, contextvars, marshal, and pydoc_data, which holds the language reference's text) are left
out by name here, and prepare_corpus.py drops every paragraph that shares a 13-word sequence with
a held-out page (leakage_filter), whatever its source.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path

DOC_ROOT = Path("/usr/share/doc")
# python3.11-doc is prepare_corpus's own source (with its held-out rule); other doc trees of
# the Python documentation itself would repeat the held-out pages.
# The Debian (bookworm) documentation packages of the shipped demo's corpus, besides
# python3.11-doc and the fortunes: `apt-get install $(python doc_sources.py --packages)`.
DEBIAN_DOC_PACKAGES = """
    cython-doc python-aiohttp-doc python-apsw-doc python-arrow-doc python-astropy-doc
    python-attr-doc python-babel-doc python-biopython-doc python-black-doc python-bottle-doc
    python-celery-doc python-cffi-doc python-cherrypy3-doc python-click-doc python-cliff-doc
    python-coverage-doc python-cryptography-doc python-dask-doc python-distributed-doc
    python-django-doc python-eventlet-doc python-flask-doc python-future-doc python-genshi-doc
    python-gevent-doc python-greenlet-doc python-h5py-doc python-hypothesis-doc
    python-ipython-doc python-jinja2-doc python-jupyter-client-doc python-kombu-doc
    python-ldap-doc python-lxml-doc python-mako-doc python-markdown-doc python-nbconvert-doc
    python-nbformat-doc python-notebook-doc python-openssl-doc python-oslo.config-doc
    python-pandas-doc python-parso-doc python-pecan-doc python-peewee-doc python-persistent-doc
    python-pexpect-doc python-pg8000-doc python-pil-doc python-psycopg2-doc python-pygments-doc
    python-pymongo-doc python-pymysql-doc python-pytest-doc python-pythran-doc python-rdflib-doc
    python-requests-doc python-scipy-doc python-scrapy-doc python-setuptools-doc
    python-simplejson-doc python-six-doc python-skimage-doc python-sklearn-doc
    python-sortedcontainers-doc python-sqlalchemy-doc python-sqlparse-doc python-statsmodels-doc
    python-stevedore-doc python-structlog-doc python-sympy-doc python-tables-doc
    python-toolz-doc python-tornado-doc python-traitlets-doc python-urwid-doc python-uvicorn-doc
    python-webob-doc python-werkzeug-doc python-whoosh-doc python-xarray-doc sphinx-doc
""".split()

SKIP_DOC_DIRS = {"python3.11", "python3-doc", "python3.11-doc", "python3"}
# Standard library modules documented by held-out pages, and the language reference's text.
SKIP_MODULES = {"logging", "contextvars", "_contextvars", "marshal", "pydoc_data", "test", "idlelib",
                "lib2to3", "turtledemo", "ensurepip", "lily"}


def _digest(text: str) -> str:
    return hashlib.sha1(re.sub(r"\s+", " ", text).strip().encode()).hexdigest()


# --- Sphinx sources and HTML pages of Debian's *-doc packages -------------------------------------


class _PageText(HTMLParser):
    """The readable text of a Sphinx/HTML page: block elements become paragraphs, navigation,
    scripts and styles are dropped, <pre> keeps its lines."""

    BLOCK = {"p", "div", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "tr", "br",
             "section", "blockquote", "table"}
    SKIP = {"script", "style", "nav", "head", "footer", "header"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        if tag in self.SKIP or "sphinxsidebar" in cls or "related" in cls or "headerlink" in cls:
            self.skip += 1
            self._skip_tag = tag
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if self.skip and tag in self.SKIP | {"div", "a"} and getattr(self, "_skip_tag", None) == tag:
            self.skip -= 1
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        t = "".join(self.parts)
        t = re.sub(r"[ \t]+\n", "\n", t)
        t = re.sub(r"\n{3,}", "\n\n", t)
        return "\n\n".join(p.strip(" ") for p in t.split("\n\n") if p.strip()) + "\n"


def html_text(src: str) -> str:
    # Sphinx puts the page body in <div role="main"> or <div class="body">: take from there.
    m = re.search(r'<div[^>]*(role="main"|class="body")[^>]*>', src)
    if m:
        src = src[m.start():]
    p = _PageText()
    p.feed(src)
    return p.text()


def sphinx_documents(rst_to_text) -> Iterator[tuple[str, str, str]]:
    """(package, key, text) for every documentation page of the installed *-doc packages."""
    seen: set[str] = set()
    # resolve(): python3.11-dev and python3.11-venv are links to python3.11, the Python docs.
    for pkg in sorted(p for p in DOC_ROOT.iterdir() if p.is_dir() and p.resolve().name not in SKIP_DOC_DIRS):
        sources = sorted(f for f in pkg.rglob("*.txt") if "_sources" in f.parts and f.is_file())
        if sources:
            for f in sources:
                real = str(f.resolve())
                if real in seen or "changelog" in f.name.lower() or "/changes" in real.lower():
                    continue
                seen.add(real)
                src = f.read_text(encoding="utf-8", errors="replace")
                text = src if f.name.endswith(".md.txt") else rst_to_text(src)
                yield pkg.name, str(f.relative_to(pkg)), text
            continue
        if not pkg.name.endswith("-doc"):  # HTML pages only from documentation packages
            continue
        for f in sorted(f for f in pkg.rglob("*.html") if f.is_file()):
            real = str(f.resolve())
            low = real.lower()
            if real in seen or any(s in low for s in ("genindex", "/search", "py-modindex", "changelog",
                                                        "/_modules/", "/changes", "releases")):
                continue
            seen.add(real)
            yield pkg.name, str(f.relative_to(pkg)), html_text(f.read_text(encoding="utf-8", errors="replace"))


# --- docstrings of Python sources -----------------------------------------------------------------


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, prefix: str) -> str:
    if isinstance(node, ast.ClassDef):
        return f"class {prefix}{node.name}"
    args = ast.unparse(node.args)
    args = re.sub(r"^self, |^self$|^cls, |^cls$", "", args)
    return f"{prefix}{node.name}({args})"


def module_text(src: str, module: str) -> str:
    """A module's docstrings laid out like the Python docs: signature line, indented description."""
    tree = ast.parse(src)
    out = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(f"{module} module\n\n{doc.strip()}")

    def walk(body, prefix: str, depth: int) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_") and node.name != "__init__":
                continue
            d = ast.get_docstring(node)
            if d and len(d) > 40:
                sig = _signature(node, prefix)
                out.append(textwrap.indent(sig + "\n\n" + textwrap.indent(d.strip(), "   "), "   " * depth))
            if isinstance(node, ast.ClassDef) and depth < 2:
                walk(node.body, prefix + node.name + ".", depth + 1)

    walk(tree.body, module + "." if module else "", 0)
    return "\n\n".join(out) + "\n" if out else ""


def python_roots() -> list[tuple[str, Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    roots = [("stdlib", stdlib)]
    site = Path(sysconfig.get_paths()["purelib"])
    if site.is_dir():
        roots.append(("site", site))
    return roots


def docstring_documents() -> Iterator[tuple[str, str, str]]:
    """(root, module, text) for each module with docstrings, standard library then site-packages."""
    for name, root in python_roots():
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root)
            parts = rel.parts
            if name == "stdlib" and parts[0] in ("site-packages", "dist-packages"):
                continue
            if parts[0].split(".")[0] in SKIP_MODULES or any(p in ("tests", "test", "testing") for p in parts):
                continue
            module = ".".join(parts)[:-3].removesuffix(".__init__")
            try:
                src = f.read_text(encoding="utf-8")
                text = module_text(src, module)
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
                continue
            if len(text) > 200:
                yield name, module, text


# --- leakage: no 13-word sequence of a held-out page -----------------------------------------------

NGRAM = 13


def word_ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def leakage_filter(heldout_texts: list[str]) -> Callable[[str], tuple[str, int]]:
    """A function text -> (text without the paragraphs that share a 13-word sequence with the
    held-out pages, number of paragraphs dropped)."""
    banned: set[tuple[str, ...]] = set()
    for t in heldout_texts:
        banned |= word_ngrams(t)

    def clean(text: str) -> tuple[str, int]:
        paras = text.split("\n\n")
        keep = [p for p in paras if not (word_ngrams(p) & banned)]
        return "\n\n".join(keep), len(paras) - len(keep)

    return clean


def dedupe() -> Callable[[str], bool]:
    seen: set[str] = set()

    def fresh(text: str) -> bool:
        d = _digest(text)
        if d in seen:
            return False
        seen.add(d)
        return True

    return fresh


if __name__ == "__main__":  # the package list, or a census of what they give
    if sys.argv[1:] == ["--packages"]:
        print(" ".join(["python3.11-doc", "fortunes", "fortunes-min", *DEBIAN_DOC_PACKAGES]))
        raise SystemExit
    sys.path.insert(0, str(Path(__file__).parent))
    from prepare_corpus import rst_to_text

    sizes: dict[str, int] = {}
    for pkg, _key, text in sphinx_documents(rst_to_text):
        sizes[pkg] = sizes.get(pkg, 0) + len(text)
    for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]):
        print(f"{v / 1e6:8.2f} MB  {k}")
    n = sum(len(t) for _, _, t in docstring_documents())
    print(f"docstrings {n / 1e6:.1f} MB")
