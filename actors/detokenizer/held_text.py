"""The text a detokenizer holds back while it may still become a marker: a stop string, or a reasoning marker."""

from __future__ import annotations


def held_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker (it may yet become one)."""
    longest = max((len(s) for s in markers), default=1) - 1
    for k in range(min(len(text), longest), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in markers):
            return k
    return 0
