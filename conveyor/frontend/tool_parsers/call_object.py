"""One tool call's JSON object, read character by character as a model writes it.

`{"name": "f", "arguments": {...}}` (the arguments key may be `parameters`, keys in any order).
The reader follows the object's top level exactly (keys, colons, commas) and the nesting of its
values (brackets and strings), so it knows at once when the name is complete, where the
arguments' text begins, and where the object ends; the whole object is checked with `json.loads`
when it closes. The arguments are handed out as the model's own text, so the pieces a stream sends
add up to the text a whole-output parse returns.
"""
from __future__ import annotations

import json

_WS = " \t\n\r"


class CallReader:
    """What a reader of one call shares, whatever the call's syntax: `state` ends in "done" or
    "error"; `feed`, `name` (and `name_checked`), `valid` and the arguments are each reader's."""
    state = "start"

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def error(self) -> bool:
        return self.state == "error"


class CallObject(CallReader):
    def __init__(self, arg_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.arg_keys = arg_keys
        self.text = ""                      # the object's text so far, from its "{"
        self.state = "start"                # start key colon value after | done error
        self.name: str | None = None        # once its string is complete and well formed
        self.valid = False                  # done, parsed, and a call (name is a string)
        self._key: str | None = None        # the top-level key whose value is being read
        self._keys: set[str] = set()
        self._start: int | None = None      # where the current string or value began
        self._kind = ""                     # the current value's first character
        self._depth = 0                     # bracket depth inside an object or array value
        self._in_str = self._esc = False
        self._args: tuple[int, int | None] | None = None   # the arguments value's span

    def feed(self, s: str) -> int:
        """Read characters of `s` until the object ends or breaks; returns how many it took."""
        for i, ch in enumerate(s):
            if self.state in ("done", "error"):
                return i
            if not self._step(ch):        # a literal ended at `ch`: read it again after it
                if self.state in ("done", "error"):
                    return i
                self._step(ch)
        return len(s)

    def arguments_so_far(self) -> str:
        """The arguments' text as far as it is known (a string value only once complete)."""
        if self._args is None:
            return ""
        start, end = self._args
        if self._arg_is_string:
            return json.loads(self.text[start:end]) if end is not None else ""
        return self.text[start:end] if end is not None else self.text[start:]

    def arguments(self) -> str:
        """The arguments of a finished call ("{}" if it had none)."""
        return self.arguments_so_far() if self._args is not None else "{}"

    def name_checked(self) -> bool:
        """Whether the text up to the end of the name is a well-formed start of an object."""
        if self.name is None:
            return False
        try:
            json.loads(self.text[:self._name_end] + "}")
            return True
        except ValueError:
            return False

    # --- the state machine --------------------------------------------------------------------

    def _step(self, ch: str) -> bool:
        """Take one character; False if it ended a literal and belongs to the next state."""
        pos = len(self.text)
        state = self.state
        if state == "start":
            if ch != "{":
                self.state = "error"
                return True
            self.text += ch
            self.state = "key"
            return True
        self.text += ch
        if state == "key":
            if self._start is not None:                       # inside the key's string
                if self._string_ends(ch):
                    self._key = json.loads(self.text[self._start:])
                    self._start = None
                    self.state = "error" if self._key in self._keys else "colon"
                    self._keys.add(self._key)
            elif ch == '"':
                self._start, self._in_str = pos, True
            elif ch == "}" and not self._keys:
                self._close()
            elif ch not in _WS:
                self.state = "error"
        elif state == "colon":
            if ch == ":":
                self.state = "value"
            elif ch not in _WS:
                self.state = "error"
        elif state == "value":
            return self._value(ch, pos)
        elif state == "after":
            if ch == ",":
                self.state = "key"
            elif ch == "}":
                self._close()
            elif ch not in _WS:
                self.state = "error"
        return True

    def _value(self, ch: str, pos: int) -> bool:
        if self._start is None:
            if ch in _WS:
                return True
            self._start, self._kind = pos, ch
            if ch in "{[":
                self._depth = 1
            elif ch == '"':
                self._in_str = True
            elif ch in "}],:":
                self.state = "error"
            if self._key in self.arg_keys:
                self._args = (pos, None)
            return True
        kind = self._kind
        if kind == '"':
            if self._string_ends(ch):
                self._end_value(pos + 1)
        elif kind in "{[":
            if self._in_str:
                self._string_ends(ch)
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value(pos + 1)
        elif ch in _WS or ch in ",}":                          # a literal ends before `ch`
            self.text = self.text[:-1]
            self._end_value(pos)
            return False
        return True

    def _string_ends(self, ch: str) -> bool:
        if self._esc:
            self._esc = False
        elif ch == "\\":
            self._esc = True
        elif ch == '"':
            self._in_str = False
            return True
        return False

    def _end_value(self, end: int) -> None:
        raw = self.text[self._start:end]
        if self._kind not in "{[":                            # strings and literals: check now
            try:
                value = json.loads(raw)
            except ValueError:
                self.state = "error"
                return
            if self._key == "name":
                if not isinstance(value, str):
                    self.state = "error"
                    return
                self.name, self._name_end = value, end
        if self._key in self.arg_keys:
            self._args = (self._start, end)
        self._start, self.state = None, "after"

    def _close(self) -> None:
        self.state = "done"
        try:
            obj = json.loads(self.text)
        except ValueError:
            return
        args = next((obj[k] for k in self.arg_keys if k in obj), {})
        self.valid = isinstance(obj.get("name"), str) and isinstance(args, (dict, str))

    @property
    def _arg_is_string(self) -> bool:
        return self._args is not None and self.text[self._args[0]] == '"'
