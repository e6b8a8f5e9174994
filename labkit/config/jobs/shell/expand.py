"""Bash's expansions over a launch script's variables (labkit/config/jobs/shell/ runs the script):
parameters and their operators, arrays, arithmetic, word splitting and quote removal, assignments
(GNU Bash manual, "Shell Parameter Expansion", "Word Splitting", "Arrays"). A command substitution
is never run: its value is a marker (MARK) that says where it came from, wherever the text goes."""

from __future__ import annotations

import fnmatch
import re

from labkit.config.choices import ConfigError
from labkit.config.jobs.shell.arith import arithmetic
from labkit.config.jobs.shell.words import Part, Scanner

MARK = re.compile("\x00(\\d+)\x00")
"""An unknown value's place in a string: it survives concatenation, and says where it came from."""


def as_text(v) -> str:
    """A value as bash reads it in a string: an array's first element, unset as empty."""
    if v is None:
        return ""
    if isinstance(v, list):
        return v[0] if v else ""
    return v


class Expander:
    """The script's variables and positional arguments, and bash's expansions over them."""

    def __init__(self, args, env, name: str):
        self.name = name
        self.vars: dict[str, object] = dict(env or {})
        self.args = [str(a) for a in args or ()]
        self.assigned_at: dict[str, int] = {}
        self.unknowns: list[str] = []

    def unknown(self, why: str) -> str:
        """A value labkit cannot know, as a marker in the text that carries it."""
        self.unknowns.append(why)
        return f"\x00{len(self.unknowns) - 1}\x00"

    def why(self, text: str) -> str | None:
        """Where the first unknown part of `text` came from; None when it has none."""
        m = MARK.search(text) if isinstance(text, str) else None
        return self.unknowns[int(m.group(1))] if m else None

    def fail(self, line: int, what: str):
        raise ConfigError([f"{self.name} line {line}: {what}"])

    # -- expansions -----------------------------------------------------------------------------
    def value(self, name: str, line: int):
        if name.isdigit():
            n = int(name)
            return self.name if n == 0 else (self.args[n - 1] if n <= len(self.args) else None)
        if name == "#":
            return str(len(self.args))
        if name in ("@", "*"):
            return list(self.args)
        if name in ("?", "$", "!", "-"):
            return self.unknown(f"${name}, known only when the script runs")
        return self.vars.get(name)

    def param(self, text: str, line: int, quoted: bool):
        """${...} or $NAME: a string, or a list of fields for "$@" / "${A[@]}" (None: unset)."""
        m = re.fullmatch(r"#([A-Za-z_]\w*|[@*])(\[[@*]\])?", text)
        if m:  # ${#X}, ${#A[@]}
            v = self.value(m.group(1), line)
            if m.group(2) or m.group(1) in "@*":
                return str(len(v if isinstance(v, list) else [] if v is None else [v]))
            return str(len(as_text(v)))
        m = re.fullmatch(r"([A-Za-z_]\w*|\d+|[@*#?$!-])(?:\[([^\]]*)\])?(.*)", text, re.S)
        if not m:
            self.fail(line, f"${{{text}}} is not an expansion labkit reads; write the value")
        name, index, op = m.groups()
        v = self.value(name, line)
        cut = re.fullmatch(r":\s*(-?\w+)(?::\s*(\w+))?", op or "")
        if cut and (name in "@*" or index in ("@", "*")):  # ${@:2}, ${A[@]:1:3}: a slice of the elements
            items = ([self.name] + self.args) if name in "@*" else (v if isinstance(v, list) else [])
            start = int(arithmetic(cut.group(1), self.number, line, self.fail))
            n = None if cut.group(2) is None else int(arithmetic(cut.group(2), self.number, line, self.fail))
            items = items[start:] if n is None else items[start : start + n]
            return items if not quoted or (name == "@" or index == "@") else " ".join(items)
        if index is not None:
            items = v if isinstance(v, list) else ([] if v is None else [v])
            if index in ("@", "*"):
                v = list(items) if index == "@" or not quoted else " ".join(items)
            else:
                i = int(arithmetic(index, self.number, line, self.fail))
                v = items[i] if -len(items) <= i < len(items) else None
        elif isinstance(v, list) and name not in ("@", "*"):
            v = v[0] if v else None  # $A is ${A[0]}
        elif name == "*" and quoted:
            v = " ".join(v)
        return self.operate(name, v, op, line, quoted) if op else v

    def operate(self, name: str, v, op: str, line: int, quoted: bool):
        m = re.fullmatch(r"(:?)([-=+?])(.*)", op, re.S)
        if m:
            colon, kind, word = m.groups()
            empty = v is None or (colon and as_text(v) == "")
            if kind == "-":
                return self.word_text(word, line) if empty else v
            if kind == "=":
                if empty:
                    v = self.word_text(word, line)
                    self.vars[name] = v
                return v
            if kind == "+":
                return "" if empty else self.word_text(word, line)
            if empty:  # ${X:?message}: bash stops the script here
                self.fail(line, f"${{{name}:?}}: the script stops unless {name} is set; give it (env=)")
            return v
        text = as_text(v)
        if self.why(text):
            return text
        m = re.fullmatch(r"(%%|%|##|#)(.*)", op, re.S)
        if m:
            kind, pattern = m.group(1), self.word_text(m.group(2), line)
            cuts = range(len(text) + 1)
            if kind.startswith("%"):
                order = list(cuts) if kind == "%%" else list(reversed(cuts))
                return next((text[:i] for i in order if fnmatch.fnmatchcase(text[i:], pattern)), text)
            order = list(reversed(cuts)) if kind == "##" else list(cuts)
            return next((text[i:] for i in order if fnmatch.fnmatchcase(text[:i], pattern)), text)
        m = re.fullmatch(r"(//?)([^/]*)/?(.*)", op, re.S)
        if m:
            pattern, repl = self.word_text(m.group(2), line), self.word_text(m.group(3), line)
            regex = fnmatch.translate(pattern)[4:-3]  # '(?s:...)\Z' -> the pattern itself
            return re.sub(regex, lambda _: repl, text, count=0 if m.group(1) == "//" else 1)
        m = re.fullmatch(r":\s*(-?\w+)(?::(\w+))?", op)
        if m:
            start = int(arithmetic(m.group(1), self.number, line, self.fail))
            end = None if m.group(2) is None else start + int(arithmetic(m.group(2), self.number, line, self.fail))
            return text[start:end]
        self.fail(line, f"${{{name}{op}}} is not an expansion labkit reads; write the value")
        return None

    def number(self, name: str, line: int) -> int:
        """A variable's value in arithmetic: its own arithmetic value, 0 when empty (bash's rule)."""
        text = as_text(self.value(name, line))
        if self.why(text):
            self.fail(line, f"the arithmetic uses {name}, whose value comes from {self.why(text)}")
        return int(arithmetic(text, self.number, line, self.fail)) if text.strip() else 0

    def part(self, p: Part, line: int):
        if p.kind == "lit":
            return p.text
        if p.kind == "param":
            return self.param(p.text, line, p.quoted)
        if p.kind == "arith":  # parameters expand first, then the arithmetic (bash's order)
            text = self.dollars(p.text, line)
            if self.why(text):
                self.fail(line, f"$(( {p.text.strip()} )) uses the output of {self.why(text)}; write the value")
            return str(arithmetic(text, self.number, line, self.fail))
        return self.unknown(f"`{p.text.strip()}` (line {line}), a command labkit never runs")

    def word_text(self, text: str, line: int) -> str:
        """A word inside an expansion (${X:-word}): expanded, without splitting."""
        return self.joined(Scanner(text, self.name).word(meta=False) or (), line)

    def dollars(self, text: str, line: int) -> str:
        """$X and ${X...} in arithmetic's text replaced by their values."""

        def one(m):
            return as_text(self.param(m.group(1) or m.group(2), line, True))

        return re.sub(r"\$\{([^}]*)\}|\$([A-Za-z_]\w*|\d)", one, text)

    def joined(self, word, line: int) -> str:
        """A word's value as one string: an assignment's value, a [[ ]] operand, a case subject."""
        # "${A[@]}" in a string joins the elements with spaces, as "${A[*]}" does
        return "".join(" ".join(v) if isinstance(v, list) else as_text(v) for v in (self.part(p, line) for p in word))

    def fields(self, word, line: int) -> list[str]:
        """A word's fields, as bash splits them: unquoted expansions split on whitespace."""
        out: list[str] = []
        cur, have = "", False  # have: the current field exists (a quoted empty string makes one)
        for p in word:
            v = self.part(p, line)
            if isinstance(v, list):  # "$@", "${A[@]}": one field per element, joined to its neighbours
                pieces = v if p.quoted else [w for x in v for w in x.split()]
                for k, piece in enumerate(pieces):
                    if k:
                        out.append(cur)
                        cur = ""
                    cur, have = cur + piece, True
                continue
            v = as_text(v)
            if p.quoted or p.kind == "lit":
                cur, have = cur + v, have or p.quoted or v != ""
                continue
            pieces = re.split(r"[ \t\n]+", v)
            if v[:1].isspace() and have:
                out.append(cur)
                cur, have = "", False
            pieces = [x for x in pieces if x]
            for k, piece in enumerate(pieces):
                if k:
                    out.append(cur)
                cur, have = (cur if k == 0 else "") + piece, True
            if v[-1:].isspace() and have:
                out.append(cur)
                cur, have = "", False
        if have:
            out.append(cur)
        return out

    def all_fields(self, words, line: int) -> list[str]:
        return [f for w in words for f in self.fields(w, line)]

    # -- assignments ----------------------------------------------------------------------------
    def assign(self, a: tuple, line: int) -> None:
        name, index, op, value = a
        old = self.vars.get(name)
        if isinstance(value, list):  # NAME=(words), NAME+=(words)
            items = self.all_fields(value, line)
            base = (old if isinstance(old, list) else [] if old is None else [old]) if op == "+=" else []
            self.vars[name] = base + items
        elif index is not None:
            items = old if isinstance(old, list) else [] if old is None else [old]
            i = int(arithmetic(index, self.number, line, self.fail))
            items = items + [""] * (i + 1 - len(items))
            items[i] = (items[i] if op == "+=" else "") + self.joined(value, line)
            self.vars[name] = items
        else:
            text = self.joined(value, line)
            if op == "+=" and isinstance(old, list):  # A+=x on an array appends to its first element
                self.vars[name] = [(old[0] if old else "") + text, *old[1:]]
                self.assigned_at[name] = line
                return
            if op == "+=":
                text = as_text(old) + text
            self.vars[name] = text
        self.assigned_at[name] = line
