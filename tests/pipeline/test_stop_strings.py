"""StopStringMatcher: stops found across delta boundaries, trimmed, never leaked early."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.pipeline.detokenizer.stop_strings import StopStringMatcher


def run(stops, deltas, include=False, flush=True):
    """Feeds the deltas; returns (emitted pieces, matched stop or None)."""
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    pieces, matched = [], None
    for delta in deltas:
        text, stop = matcher.feed(delta)
        pieces.append(text)
        if stop is not None:
            assert matched is None, "a second match was reported"
            matched = stop
    if flush:
        pieces.append(matcher.flush())
    return pieces, matched


def reference(stops, text, include=False):
    """What a non-streaming server returns: cut at the stop string that completes first."""
    best = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or (i + len(stop), -len(stop)) < (best[0] + len(best[1]),
                                                                        -len(best[1]))):
            best = (i, stop)
    if best is None:
        return text, None
    i, stop = best
    return text[:i + len(stop)] if include else text[:i], stop


def test_stop_spanning_two_deltas_is_trimmed():
    pieces, matched = run(["###"], ["Answer: 42 #", "## more text"])
    assert matched == "###"
    assert pieces == ["Answer: 42 ", "", ""]


def test_include_stop_str_in_output():
    pieces, matched = run(["</s>"], ["a</", "s>b"], include=True)
    assert (pieces, matched) == (["a", "</s>", ""], "</s>")


def test_partial_prefix_is_held_then_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", None)
    assert matcher.feed("ART") == ("START", None)
    assert matcher.feed("S") == ("", None)
    assert matcher.flush() == "S"


def test_held_back_is_at_most_longest_stop_minus_one():
    matcher = StopStringMatcher(["abcd", "xy"])
    assert matcher.feed("zzabc") == ("zz", None)
    assert matcher.feed("x") == ("abc", None)     # "abcx" cannot start "abcd"; "x" may start "xy"
    assert matcher.feed("z") == ("xz", None)


def test_text_after_match_is_dropped():
    matcher = StopStringMatcher(["."])
    assert matcher.feed("One. Two.") == ("One", ".")
    assert matcher.finished
    assert matcher.feed("Three") == ("", None)
    assert matcher.flush() == ""


def test_multiple_stops_first_completed_wins():
    # "b" completes before "abc" does, whatever the chunking.
    assert run(["abc", "b"], ["xabcy"]) == (["xa", ""], "b")
    assert run(["abc", "b"], ["xa", "bcy"]) == (["x", "a", ""], "b")
    # Two stops completing at the same character: the longer one started first and is trimmed.
    assert run(["c", "abc"], ["xab", "c"]) == (["x", "", ""], "abc")


def test_overlapping_prefixes():
    # "aab" only appears after a false start "aa" + "a"; the held text must slide, not reset.
    pieces, matched = run(["aab"], ["xa", "a", "a", "b!"])
    assert ("".join(pieces), matched) == ("xa", "aab")
    pieces, matched = run(["abab"], ["aba", "aba", "b"])   # "abaabab": the match starts at 3
    assert (pieces, matched) == (["", "aba", "", ""], "abab")


def test_no_stops_passes_text_straight_through():
    assert run([], ["a", "b"]) == (["a", "b", ""], None)


def test_can_stop_false_lets_a_stop_through_as_text():
    matcher = StopStringMatcher(["!"])
    assert matcher.feed("hi!", can_stop=False) == ("hi!", None)
    assert matcher.feed("yo!") == ("yo", "!")


def test_unicode_stops_across_deltas():
    pieces, matched = run(["。\n", "🛑"], ["你好", "。", "\n再见"])
    assert ("".join(pieces), matched) == ("你好", "。\n")
    pieces, matched = run(["🛑"], ["ok 🛑 no"], include=True)
    assert ("".join(pieces), matched) == ("ok 🛑", "🛑")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc.🛑", max_size=30),
       stops=st.lists(st.text(alphabet="abc.🛑", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8), include=st.booleans())
def test_streaming_equals_matching_the_whole_text(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted, fed, matched = "", "", None
    longest = max((len(s) for s in stops), default=1)
    for delta in deltas:
        piece, stop = matcher.feed(delta)
        emitted, fed = emitted + piece, fed + delta
        matched = matched or stop
        if matched is None:  # no leak, and never more held back than could still be a stop
            assert fed.startswith(emitted)
            assert len(fed) - len(emitted) <= longest - 1
    emitted += matcher.flush()
    assert (emitted, matched) == reference(stops, text, include)


@pytest.mark.parametrize("stops", [["STOP"], ["xyz", "STOP"]])
def test_hold_back_bound(stops):
    matcher = StopStringMatcher(stops)
    fed = emitted = ""
    for ch in "aSTOxSTSTO":
        fed += ch
        emitted += matcher.feed(ch)[0]
        assert fed.startswith(emitted)
        assert len(fed) - len(emitted) <= max(map(len, stops)) - 1
