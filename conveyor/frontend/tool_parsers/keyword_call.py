"""A call written as a name and then its arguments one keyword at a time (Python's `f(a=1)`,
Qwen3-Coder's `<parameter=a>`): what its readers share with `CallObject`'s interface.

A reader subclass reads its syntax and calls `_add` as each argument's value is complete; the
arguments' JSON text grows by whole members, so what a stream has sent is always a start of the
final text.
"""
from __future__ import annotations

import json

from conveyor.frontend.tool_parsers.call_object import CallReader


class KeywordCall(CallReader):
    def __init__(self) -> None:
        self.text = ""                      # the call's text so far
        self.state = "start"                # the subclass's states, then done | error
        self.name: str | None = None
        self._keys: set[str] = set()
        self._json = ""                     # the arguments so far, as JSON text without its "}"

    @property
    def valid(self) -> bool:
        return self.done

    def name_checked(self) -> bool:
        return self.name is not None

    def arguments_so_far(self) -> str:
        return self._json

    def arguments(self) -> str:
        return (self._json or "{") + "}"

    def _add(self, key: str, value_json: str) -> bool:
        """One argument's member; False (and the call breaks) if its key came before."""
        if key in self._keys:
            self.state = "error"
            return False
        self._keys.add(key)
        self._json += ("{" if not self._json else ", ") + dumps(key) + ": " + value_json
        return True


def dumps(value) -> str:
    """JSON text of a value read from a model's output (TypeError or ValueError if it has none,
    e.g. a set, bytes or NaN)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)
