"""Shared fixture: the Qwen3.5 tokenizer folder built by scripts/make_tokenizer.py (cached)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import make_tokenizer  # noqa: E402

TEMPLATE_PATH = ROOT / "src" / "lily" / "templates" / "qwen3_5_chat_template.jinja"


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    return make_tokenizer.ensure_tokenizer()
