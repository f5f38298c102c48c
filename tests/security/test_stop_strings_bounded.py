"""StopStringMatcher (issue 38): the same output as the matcher it replaced, delta by delta, with
memory linear in the stop strings and automaton steps linear in the text fed."""
from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.pipeline.detokenizer.stop_strings import StopStringMatcher


class PrefixSetMatcher:
    """The matcher this module had before issue 38, kept as the reference of its semantics: a
    set of every proper prefix of every stop string, and str.find over the held text + delta."""

    def __init__(self, stops, include_stop_str_in_output=False):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.include = include_stop_str_in_output
        self.matched = None
        self._held = ""
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._max_held = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta, *, can_stop=True):
        if self.matched is not None:
            return "", None
        if not self.stops:
            return delta, None
        text = self._held + delta
        if can_stop:
            found = [(text.find(s) + len(s), -len(s), s) for s in self.stops if s in text]
            if found:
                end, neg_len, stop = min(found)
                self.matched, self._held = stop, ""
                return text[:end if self.include else end + neg_len], stop
        keep = next((k for k in range(min(self._max_held, len(text)), 0, -1)
                     if text[len(text) - k:] in self._prefixes), 0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self):
        held, self._held = self._held, ""
        return "" if self.matched is not None else held


ALPHABET = "aab.🛑"


@settings(max_examples=500, deadline=None)
@given(stops=st.lists(st.text(alphabet=ALPHABET, max_size=6), max_size=5),
       feeds=st.lists(st.tuples(st.text(alphabet=ALPHABET, max_size=8), st.booleans(),
                                st.booleans()), max_size=12),
       include=st.booleans())
def test_every_feed_and_flush_equals_the_prefix_set_matcher(stops, feeds, include):
    """Any deltas, any can_stop sequence (not only False then True), flushes in between."""
    new = StopStringMatcher(stops, include_stop_str_in_output=include)
    old = PrefixSetMatcher(stops, include_stop_str_in_output=include)
    for delta, can_stop, flush in feeds:
        assert new.feed(delta, can_stop=can_stop) == old.feed(delta, can_stop=can_stop)
        assert new.matched == old.matched
        if flush:
            assert new.flush() == old.flush()
    assert new.flush() == old.flush()


def test_a_stop_completed_while_stops_were_off_ends_the_next_feed_that_can_stop():
    # "b" passed inside the held-back "xby" (a start of "xbyz") before min_tokens; the next
    # feed that may stop finds it there, as the prefix-set matcher did.
    for matcher in (StopStringMatcher(["b", "xbyz"]), PrefixSetMatcher(["b", "xbyz"])):
        assert matcher.feed("axby", can_stop=False) == ("a", None)
        assert matcher.feed("q") == ("x", "b")


def test_stops_sharing_prefixes_and_stops_inside_stops():
    stops = ["abcd", "abx", "bc", "ab", "c"]
    assert StopStringMatcher(stops).feed("zabx") == ("z", "ab")  # "ab" ends before "abx"
    assert StopStringMatcher(stops).feed("zab", can_stop=False) == ("z", None)
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("za") == ("z", None)
    assert matcher.feed("bc") == ("a", "bc")
    # Two stops ending at the same character: the longer one started first.
    assert StopStringMatcher(["bc", "abc", "abcd"]).feed("xabcd") == ("x", "abc")


class _CountingFail:
    """The automaton's failure links, counting how often the matcher follows one."""

    def __init__(self, fail):
        self.fail, self.steps = fail, 0

    def __getitem__(self, node):
        self.steps += 1
        return self.fail[node]


def test_failure_steps_are_at_most_the_characters_fed():
    # The prefix-set matcher's worst case: a long stop whose every start is a false start.
    stop = "a" * 999 + "b"
    matcher = StopStringMatcher([stop, "acac"])
    counter = _CountingFail(matcher._automaton.fail)
    matcher._automaton.fail = counter
    text = ("a" * 998 + "c") * 20 + "ac" * 3
    fed = emitted = ""
    for i in range(0, len(text), 3):
        piece, stop_matched = matcher.feed(text[i:i + 3])
        fed, emitted = fed + text[i:i + 3], emitted + piece
        assert len(fed) - len(emitted) <= len(stop) - 1
    assert (matcher.matched, emitted) == ("acac", text[:text.index("acac")])
    assert counter.steps <= len(text)


def test_a_100000_character_stop_costs_memory_linear_in_its_length():
    stop = "ab" * 50_000  # a third of the stop string that grew the detokenizer to 2.4 GB
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([stop, "c" * 500])
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 24 * len(stop)  # 4 int32 arrays, a bytearray and the joined stops
    assert peak < 32 * len(stop)
    assert matcher.feed("ab" * 1000) == ("", None)  # all of it may start the stop
    assert matcher.feed("b") == ("ab" * 1000 + "b", None)  # "abb" can start neither
    assert matcher.feed("c" * 499) == ("", None)
    assert matcher.feed("cc") == ("", "c" * 500)


def test_samples_with_the_same_stops_share_one_automaton():
    first, second = StopStringMatcher(["x", "yz"]), StopStringMatcher(("x", "yz", "x"))
    assert first._automaton is second._automaton
    assert StopStringMatcher(["x"])._automaton is not first._automaton
