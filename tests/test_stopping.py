"""Stop strings over streamed deltas, against the whole-text answer (str.find)."""

import random

import pytest

from lily.stopping import StopStringMatcher
from lily.tokenizer import Tokenizer
from qwen_fixture import qwen_dir  # noqa: F401


def reference(text, stops):
    """Text before the earliest stop occurrence, and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def run(deltas, stops):
    m = StopStringMatcher(stops)
    out = []
    for d in deltas:
        out.append(m.feed(d))
        if m.stopped:
            break
    out.append(m.flush())
    return out, m


def random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_stop_spanning_deltas_is_honoured_and_not_emitted():
    out, m = run(["Hello <", "|im", "_e", "nd|> more"], ["<|im_end|>"])
    assert "".join(out) == "Hello "
    assert m.stopped and m.matched == "<|im_end|>"
    # The partial "<", "<|im" and "<|im_e" were held back, never shown.
    assert out[:3] == ["Hello ", "", ""]


def test_partial_match_that_fails_is_released():
    out, m = run(["a <", "|x", " b"], ["<|im_end|>"])
    assert "".join(out) == "a <|x b" and not m.stopped
    assert out == ["a ", "<|x", " b", ""]


def test_held_tail_flushed_at_end():
    out, m = run(["answer\n\nUs"], ["\n\nUser:"])
    assert out == ["answer", "\n\nUs"] and not m.stopped


def test_earliest_stop_wins():
    out, m = run(["xx STOP yy END"], ["END", "STOP"])
    assert "".join(out) == "xx " and m.matched == "STOP"


def test_bad_stops():
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher([""])
    with pytest.raises(TypeError):
        StopStringMatcher([3])
    assert StopStringMatcher("x").stops == ["x"]


def test_random_streams_match_reference():
    rng = random.Random(0)
    alphabet = "ab<|>\n "
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        out, m = run(random_split(text, rng) if text else [""], stops)
        want, stopped = reference(text, stops)
        assert "".join(out) == want, (text, stops)
        assert m.stopped == stopped
        # Nothing after the point where a stop completed was ever shown.
        assert all(s not in "".join(out) for s in stops)


def test_stop_over_real_token_stream(qwen_dir):  # noqa: F811
    tok = Tokenizer.from_dir(qwen_dir)
    text = "The answer is 42.\n\nUser: and now? 🤖"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    m = StopStringMatcher(["\n\nUser:"])
    shown = []
    for i in ids:
        shown.append(m.feed(detok.feed(i)))
        if m.stopped:
            break
    assert "".join(shown) == "The answer is 42."
    assert m.stopped
