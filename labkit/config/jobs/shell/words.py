"""A launch script's characters read into bash's words (labkit/config/jobs/shell/parse.py reads the
commands): comments, line continuations, quotes ('', "", $''), and the substitutions ${ }, $NAME,
$(( )), $( ) and `` kept as text in the word's parts (GNU Bash manual, "Quoting", "Shell Expansions");
here-documents read past (their command never runs, so their text is never expanded).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.config.choices import ConfigError

META = set(" \t\n;&|()<>")
DECLARE = {"export", "declare", "typeset", "local", "readonly"}
"""Builtins whose arguments are assignments (export X=1, declare -a A=(...))."""


@dataclass(frozen=True)
class Part:
    """A piece of a word: 'lit' text, a 'param' (the text inside ${ } or after $), an 'arith'
    $(( )) or a 'cmd' $( ) / `` substitution; `quoted`: inside quotes (no word splitting)."""

    kind: str
    text: str
    quoted: bool = False


Word = tuple  # of Part


def plain(word) -> str | None:
    """The text of a word written without quotes or substitutions (an operator, a keyword), else None."""
    if isinstance(word, str):
        return word
    if all(p.kind == "lit" and not p.quoted for p in word):
        return "".join(p.text for p in word)
    return None


class Scanner:
    """A position in a script's text and the words read from it."""

    def __init__(self, text: str, where: str = "the script"):
        self.s, self.i, self.where, self.pending = text, 0, where, []

    # -- characters ---------------------------------------------------------------------------
    def line(self, at: int | None = None) -> int:
        return self.s.count("\n", 0, self.i if at is None else at) + 1

    def fail(self, what: str, at: int | None = None):
        raise ConfigError([f"{self.where} line {self.line(at)}: {what}"])

    def peek(self, n: int = 1) -> str:
        return self.s[self.i : self.i + n]

    def blanks(self, newlines: bool = False) -> None:
        """Skip spaces, continuations, comments (and newlines, reading here-documents, when asked)."""
        while self.i < len(self.s):
            c = self.peek()
            if c in " \t" or self.peek(2) == "\\\n":
                self.i += 2 if c == "\\" else 1
            elif c == "#":
                while self.i < len(self.s) and self.s[self.i] != "\n":
                    self.i += 1
            elif c == "\n" and newlines:
                self.newline()
            else:
                return

    def newline(self) -> None:
        self.i += 1
        for delim, strip in self.pending:  # here-document bodies follow the line that opened them
            while self.i < len(self.s):
                end = self.s.find("\n", self.i)
                end = len(self.s) if end < 0 else end
                text, self.i = self.s[self.i : end], min(end + 1, len(self.s))
                if (text.lstrip("\t") if strip else text) == delim:
                    break
        self.pending = []

    def closing(self, open_: str, close: str, start: int) -> int:
        """The index just past the `close` that ends the construct opened just before `start`
        (one level deep there); quotes and escapes inside are skipped, nested pairs counted."""
        s, depth, j = self.s, 1, start
        while j < len(s):
            c = s[j]
            if c == "\\":
                j += 2
            elif c == "'" and open_ != "[":
                end = s.find("'", j + 1)
                if end < 0:
                    break
                j = end + 1
            elif c == '"':
                j = self.quote_end(j + 1)
            elif s.startswith(close, j):
                depth -= 1
                j += len(close)
                if depth == 0:
                    return j
            elif s.startswith(open_, j):
                depth += 1
                j += len(open_)
            else:
                j += 1
        self.fail(f"an unclosed {open_!r} (opened here); close it", start)
        return j

    def quote_end(self, j: int) -> int:
        """The index just past the double quote that closes the one before `j`."""
        while j < len(self.s):
            if self.s[j] == "\\":
                j += 2
            elif self.s[j] == '"':
                return j + 1
            elif self.s.startswith("$(", j):
                j = self.closing("(", ")", j + 2)
            else:
                j += 1
        self.fail('an unclosed " quote; close it', j)
        return j

    # -- words ----------------------------------------------------------------------------------
    def dollar(self, quoted: bool) -> Part:
        """The substitution at $ (self.i points at '$')."""
        s, i = self.s, self.i
        if s.startswith("$((", i):
            end = self.closing("(", ")", i + 2)
            if s[end - 2 : end] != "))":
                self.fail("an unclosed $(( )); close it", i)
            self.i = end
            return Part("arith", s[i + 3 : end - 2], quoted)
        if s.startswith("$(", i):
            self.i = self.closing("(", ")", i + 2)
            return Part("cmd", s[i + 2 : self.i - 1], quoted)
        if s.startswith("${", i):
            self.i = self.closing("{", "}", i + 2)
            return Part("param", s[i + 2 : self.i - 1], quoted)
        j = i + 1
        if j < len(s) and (s[j].isalpha() or s[j] == "_"):
            while j < len(s) and (s[j].isalnum() or s[j] == "_"):
                j += 1
        elif j < len(s) and s[j] in "0123456789@*#?$!-":
            j += 1
        else:  # a lone $ is itself
            self.i = j
            return Part("lit", "$", quoted)
        self.i = j
        return Part("param", s[i + 1 : j], quoted)

    def double_quoted(self) -> list[Part]:
        out, buf = [], []
        self.i += 1
        while True:
            if self.i >= len(self.s):
                self.fail('an unclosed " quote; close it')
            c = self.peek()
            if c == '"':
                self.i += 1
                break
            if c == "\\" and self.peek(2)[1:] in ('"', "\\", "$", "`", "\n"):
                if self.peek(2)[1:] != "\n":
                    buf.append(self.peek(2)[1])
                self.i += 2
            elif c == "$" or c == "`":
                if buf:
                    out.append(Part("lit", "".join(buf), True))
                buf = []
                out.append(self.dollar(True) if c == "$" else self.backtick(True))
            else:
                buf.append(c)
                self.i += 1
        if buf or not out:  # "" is one empty word; "${A[@]}" of an empty array is none
            out.append(Part("lit", "".join(buf), True))
        return out

    def backtick(self, quoted: bool) -> Part:
        end = self.s.find("`", self.i + 1)
        if end < 0:
            self.fail("an unclosed ` (command substitution); close it")
        text, self.i = self.s[self.i + 1 : end], end + 1
        return Part("cmd", text, quoted)

    def word(self, stop: str = "", meta: bool = True) -> Word | None:
        """The word at self.i (None if none starts here); `stop`: characters that end it besides
        META; meta=False: spaces and operators are the word's own (the word of ${X:-word})."""
        parts: list[Part] = []
        start = self.i
        ends = (META if meta else set()) | set(stop)
        while self.i < len(self.s):
            c = self.peek()
            if c in ends:
                break
            if c == "\\":
                if self.peek(2) == "\\\n":
                    self.i += 2
                    continue
                parts.append(Part("lit", self.peek(2)[1:], True))
                self.i += 2
            elif c == "'":
                end = self.s.find("'", self.i + 1)
                if end < 0:
                    self.fail("an unclosed ' quote; close it")
                parts.append(Part("lit", self.s[self.i + 1 : end], True))
                self.i = end + 1
            elif c == '"':
                parts += self.double_quoted()
            elif c == "$" and self.peek(2) == "$'":
                end = self.s.find("'", self.i + 2)
                raw = self.s[self.i + 2 : end]
                parts.append(Part("lit", raw.encode().decode("unicode_escape"), True))
                self.i = end + 1
            elif c == "$":
                parts.append(self.dollar(False))
            elif c == "`":
                parts.append(self.backtick(False))
            else:
                j = self.i
                while j < len(self.s) and self.s[j] not in ends and self.s[j] not in "\\'\"$`":
                    j += 1
                parts.append(Part("lit", self.s[self.i : j]))
                self.i = j
        return tuple(parts) if self.i > start else None
