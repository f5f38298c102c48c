"""Stop-string matching over a stream of text deltas.

A stop string may arrive split across deltas, so text that could be the start of one is held
back until the next delta shows whether it is (at most max(len(stop)) - 1 characters). The
match reported is the stop string that *completes* first in the text, which is where generation
would have stopped had the text arrived one character at a time; the result therefore does not
depend on how the text was split into deltas.

The stop strings are matched by one Aho-Corasick automaton, built once per set of stop strings
and shared by every sample that uses it: its memory is linear in the stop strings' total length,
and a delta costs Python work linear in its own length (the automaton's state carries what the
earlier text could still become). Sets of every prefix of every stop string, rescanned per
delta, were quadratic in a stop string's length: one stop string of 300,000 characters grew
the detokenizer to 2.4 GB.
"""
from __future__ import annotations

import weakref
from array import array
from typing import Iterable


class StopStringMatcher:
    """Feed text deltas; get back the text safe to show and the stop string once one matched."""

    def __init__(self, stops: Iterable[str], include_stop_str_in_output: bool = False):
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None
        self._held = ""
        self._automaton = _shared_automaton(self.stops) if self.stops else None
        self._node = 0  # the automaton's node for self._held
        # Text let through with can_stop=False may hold a whole stop string in its held-back
        # tail; the first feed that can stop looks for it there too.
        self._held_unchecked = False

    @property
    def finished(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str, *, can_stop: bool = True) -> tuple[str, str | None]:
        """Returns (text to emit, stop string matched by this delta or None).

        After a match, the text up to the stop string (or through it, with
        include_stop_str_in_output) is emitted and all later deltas are dropped.
        With can_stop=False (min_tokens not reached) stop strings pass through as text.
        """
        if self.matched is not None:
            return "", None
        automaton = self._automaton
        if automaton is None:
            return delta, None
        text = self._held + delta  # the held part is shorter than the longest stop string
        if can_stop and self._held_unchecked:
            node, begin = 0, 0
        else:
            node, begin = self._node, len(self._held)
        node, end, index = automaton.advance(node, text, begin, can_stop)
        if index >= 0:
            stop = self.stops[index]
            self.matched, self._held = stop, ""
            return text[:end if self.include_stop_str_in_output else end - len(stop)], stop
        node = automaton.hold[node]
        keep = automaton.depth[node]
        self._node, self._held_unchecked = node, not can_stop
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """The sequence ended without a match: the held-back text is final."""
        held, self._held = self._held, ""
        self._node, self._held_unchecked = 0, False
        return "" if self.matched is not None else held


# One automaton per distinct set of stop strings while a matcher uses it: the n samples of a
# request share theirs.
_automata: "weakref.WeakValueDictionary[tuple[str, ...], _Automaton]" = \
    weakref.WeakValueDictionary()


def _shared_automaton(stops: tuple[str, ...]) -> "_Automaton":
    automaton = _automata.get(stops)
    if automaton is None:
        automaton = _automata[stops] = _Automaton(stops)
    return automaton


class _Automaton:
    """Aho-Corasick over `stops`, in flat arrays of (total length + 1) entries.

    Node 0 is the empty prefix; node base(i) + d (d = 1..len(stops[i])) is stops[i][:d], where
    base(i) is the total length of the stops before i. A prefix several stops share is the node
    of the first of them (its "canonical" node; the others' nodes for it are never reached). A
    node's edge to the next character of its own stop is implicit (`chain`: node -> node + 1 on
    joined[node]); only the first edge where a later stop leaves an earlier one's path is kept
    in `branch`, one per stop at most.
    """

    __slots__ = ("joined", "chain", "branch", "fail", "depth", "out", "hold", "__weakref__")

    def __init__(self, stops: tuple[str, ...]):
        self.joined = "".join(stops)
        size = len(self.joined) + 1
        self.chain = bytearray(size)             # 1: the implicit edge to node + 1 exists
        self.branch: dict[tuple[int, str], int] = {}
        self.fail = array("i", [0]) * size   # the longest proper suffix that is a node
        self.depth = array("i", [0]) * size
        self.out = array("i", [-1]) * size   # the longest stop ending here (its index)
        self.hold = array("i", [0]) * size   # the longest suffix that is a proper prefix
        children = self._insert(stops)
        self._link(children)

    def _edge(self, node: int, ch: str) -> int:
        """The trie's child of `node` on `ch`, or -1."""
        if self.chain[node] and self.joined[node] == ch:
            return node + 1
        return self.branch.get((node, ch), -1)

    def _insert(self, stops: tuple[str, ...]) -> dict[int, list[int]]:
        """Builds the trie; returns each node's branch children (the chain child aside)."""
        children: dict[int, list[int]] = {}
        base = 0
        for index, stop in enumerate(stops):
            node, d = 0, 0
            while d < len(stop) and (child := self._edge(node, stop[d])) >= 0:
                node, d = child, d + 1
            if d < len(stop):  # stop leaves the trie here: its own nodes from d + 1 on
                first = base + d + 1
                if node == 0 and index == 0:
                    self.chain[0] = 1
                else:
                    self.branch[(node, stop[d])] = first
                    children.setdefault(node, []).append(first)
                node = base + len(stop)
                self.chain[first:node] = b"\x01" * (node - first)
                self.depth[first:node + 1] = array("i", range(d + 1, len(stop) + 1))
            self.out[node] = index
            base += len(stop)
        return children

    def _link(self, children: dict[int, list[int]]) -> None:
        """Failure links, outputs and hold-back nodes, breadth first (shallower nodes first)."""
        joined, chain, branch, fail, out, hold = (self.joined, self.chain, self.branch,
                                                  self.fail, self.out, self.hold)
        queue = array("i", [0])  # appended to while iterated: every node once, by depth
        for u in queue:
            kids = children.get(u)
            if chain[u]:
                kids = [u + 1] if kids is None else [u + 1, *kids]
            elif kids is None:
                hold[u] = hold[fail[u]]
                continue
            hold[u] = u
            for c in kids:
                f = fail[u] if u else -1  # the root's children fail to the root
                ch = joined[c - 1]
                while f >= 0:  # the edge on ch from the longest suffix that has one
                    if chain[f] and joined[f] == ch:
                        fail[c] = f + 1
                        break
                    v = branch.get((f, ch))
                    if v is not None:
                        fail[c] = v
                        break
                    f = fail[f] if f else -1
                if out[c] < 0:
                    out[c] = out[fail[c]]
                queue.append(c)

    def advance(self, node: int, text: str, begin: int, can_stop: bool) -> tuple[int, int, int]:
        """Runs text[begin:] from `node`: (node, end, stop index) of the first position where
        a stop ends (when can_stop), else (the node after the whole text, -1, -1)."""
        joined, chain, branch, fail, out = self.joined, self.chain, self.branch, self.fail, self.out
        for i in range(begin, len(text)):
            ch = text[i]
            while True:
                if chain[node] and joined[node] == ch:
                    node += 1
                    break
                child = branch.get((node, ch))
                if child is not None:
                    node = child
                    break
                if not node:
                    break
                node = fail[node]
            if can_stop and out[node] >= 0:
                return node, i + 1, out[node]
        return node, -1, -1
