"""A launch script parsed as bash parses it, into plain nodes (labkit/config/jobs/shell/ evaluates them).

Follows bash's grammar (the GNU Bash manual, "Shell Syntax" and "Shell Commands") for what launch
scripts are written with: comments, line continuations, quotes ('', "", $''), parameter, arithmetic
and command substitutions (kept as text, never run), simple commands with their assignments
(NAME=w, NAME+=w, NAME=(words), NAME+=(words)) and redirections (here-documents read past), pipelines,
&& and || lists, if / while / until / for / case, { } groups, ( ) subshells, [[ ]] and (( )), function
definitions. Refused with the line: `select` and `coproc`; process substitution <( ) is not read.
Brace expansion ({a,b}) is left as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.config.jobs.shell.words import DECLARE, META, Part, Scanner, Word, plain


@dataclass
class Node:
    line: int
    kind: str
    """'simple', 'andor', 'pipeline', 'if', 'while', 'until', 'for', 'case', 'group', 'subshell',
    'function', 'cond' ([[ ]]), 'arith' (( )); what each holds is in `data`."""
    data: dict = field(default_factory=dict)


class Parser(Scanner):
    """Bash's grammar over the words a Scanner reads."""

    def reserved(self, *names: str) -> str | None:
        """The reserved word at self.i among `names`, if one stands there as a whole word."""
        for n in names:
            end = self.i + len(n)
            if self.s.startswith(n, self.i) and (end >= len(self.s) or self.s[end] in META or n in ("{", "}", "!")):
                if n in ("{", "}", "!") and end < len(self.s) and self.s[end] not in " \t\n;":
                    continue
                return n
        return None

    def expect(self, name: str, what: str) -> None:
        self.blanks(newlines=True)
        if not self.reserved(name):
            self.fail(f"expected '{name}' {what}")
        self.i += len(name)

    def parse(self) -> list[Node]:
        body = self.sequence(())
        if self.i < len(self.s):
            self.fail(f"unexpected {self.s[self.i : self.i + 10]!r}")
        return body

    def sequence(self, until: tuple[str, ...]) -> list[Node]:
        """Commands up to one of the reserved words `until` (or ')' / ';;' / the end)."""
        out = []
        while True:
            self.blanks(newlines=True)
            if self.i >= len(self.s) or self.peek() == ")" or self.peek(2) == ";;" or self.reserved(*until):
                return out
            if self.peek() in ";&":
                self.fail(f"a command is missing before {self.peek()!r}")
            out.append(self.and_or())
            self.blanks()
            if self.peek() in (";", "&") and self.peek(2) not in (";;", "&&"):
                self.i += 1

    def and_or(self) -> Node:
        line = self.line()
        items = [("", self.pipeline())]
        while True:
            self.blanks()
            op = self.peek(2)
            if op not in ("&&", "||"):
                return items[0][1] if len(items) == 1 else Node(line, "andor", {"items": items})
            self.i += 2
            self.blanks(newlines=True)
            items.append((op, self.pipeline()))

    def pipeline(self) -> Node:
        line, negated = self.line(), False
        self.blanks()
        if self.reserved("!"):
            negated, self.i = True, self.i + 1
        commands = [self.command()]
        while True:
            self.blanks()
            if self.peek() != "|" or self.peek(2) == "||":
                break
            self.i += 2 if self.peek(2) == "|&" else 1
            self.blanks(newlines=True)
            commands.append(self.command())
        if len(commands) == 1 and not negated:
            return commands[0]
        return Node(line, "pipeline", {"commands": commands, "negated": negated})

    def command(self) -> Node:
        self.blanks()
        line = self.line()
        kw = self.reserved("if", "while", "until", "for", "case", "{", "function", "[[", "select", "coproc")
        if kw in ("select", "coproc"):
            self.fail(f"'{kw}' is not read; write the launch without it")
        if kw == "if":
            return self.if_(line)
        if kw in ("while", "until"):
            self.i += len(kw)
            cond = self.sequence(("do",))
            self.expect("do", f"after the {kw} condition")
            body = self.sequence(("done",))
            self.expect("done", f"to close the {kw} loop")
            return self.redirected(Node(line, kw, {"cond": cond, "body": body}))
        if kw == "for":
            return self.for_(line)
        if kw == "case":
            return self.case(line)
        if kw == "{":
            self.i += 1
            body = self.sequence(("}",))
            self.expect("}", "to close the { group")
            return self.redirected(Node(line, "group", {"body": body}))
        if kw == "function":
            self.i += len(kw)
            self.blanks()
            name = self.word()
            self.blanks()
            if self.peek(2) == "()":
                self.i += 2
            return self.function(line, name)
        if kw == "[[":
            return self.redirected(self.cond(line))
        if self.peek(2) == "((":
            end = self.closing("(", ")", self.i + 1)
            if self.s[end - 2 : end] != "))":
                self.fail("an unclosed (( )); close it")
            text, self.i = self.s[self.i + 2 : end - 2], end
            return Node(line, "arith", {"expr": text})
        if self.peek() == "(":
            self.i += 1
            body = self.sequence(())
            if self.peek() != ")":
                self.fail("an unclosed ( subshell; close it", self.i)
            self.i += 1
            return self.redirected(Node(line, "subshell", {"body": body}))
        return self.simple(line)

    def function(self, line: int, name) -> Node:
        self.blanks(newlines=True)
        body = self.command()
        return Node(line, "function", {"name": "".join(p.text for p in name or ()), "body": body})

    def redirected(self, node: Node) -> Node:
        """Redirections after a compound command: read past."""
        while True:
            self.blanks()
            if not self.redirection():
                return node

    def redirection(self) -> bool:
        j = self.i
        while j < len(self.s) and self.s[j].isdigit():
            j += 1
        for op in ("<<<", "<<-", "<<", "&>>", "&>", ">>", ">&", "<&", ">|", "<>", ">", "<"):
            if self.s.startswith(op, j):
                if op in ("&>", "&>>") and j != self.i:
                    return False
                self.i = j + len(op)
                self.blanks()
                target = self.word()
                if target is None:
                    self.fail(f"the redirection {op!r} has no target")
                if op in ("<<", "<<-"):
                    delim = "".join(p.text for p in target)
                    self.pending.append((delim, op == "<<-"))
                return True
        return False

    def simple(self, line: int) -> Node:
        assigns, words, declared = [], [], []
        while True:
            self.blanks()
            if self.i >= len(self.s) or self.peek() in "\n;&|)" or (self.peek() == "(" and not words):
                break
            if self.redirection():
                continue
            if not words or plain(words[0]) in DECLARE:
                a = self.assignment()
                if a is not None:
                    (declared if words else assigns).append(a)
                    continue
            if self.peek() == "(":  # name ( ) { ...}: a function definition
                if len(words) == 1 and self.s[self.i :].replace(" ", "").startswith("()"):
                    self.i = self.s.index(")", self.i) + 1
                    return self.function(line, words[0])
                self.fail("an unexpected '('")
            w = self.word()
            if w is None:
                self.fail(f"unexpected {self.peek()!r}")
            words.append(w)
        return Node(line, "simple", {"assigns": assigns, "words": words, "declared": declared})

    def assignment(self) -> tuple | None:
        """(name, index word or None, '+=' or '=', value word or list of words) at self.i, or None."""
        s, j = self.s, self.i
        if j >= len(s) or not (s[j].isalpha() or s[j] == "_"):
            return None
        while j < len(s) and (s[j].isalnum() or s[j] == "_"):
            j += 1
        name, index = s[self.i : j], None
        if s.startswith("[", j):
            end = self.closing("[", "]", j + 1)
            index, j = s[j + 1 : end - 1], end
        op = "+=" if s.startswith("+=", j) else "=" if s.startswith("=", j) else None
        if op is None:
            return None
        self.i = j + len(op)
        if self.peek() == "(":  # an array: words up to ')', over lines, comments inside
            opened = self.i
            self.i += 1
            items = []
            while True:
                self.blanks(newlines=True)
                if self.peek() == ")":
                    self.i += 1
                    return (name, index, op, items)
                w = self.word()
                if w is None:
                    self.fail(f"{name}=( ... ) is not closed by ')'", opened)
                items.append(w)
        return (name, index, op, self.word() or ())

    def if_(self, line: int) -> Node:
        clauses, other = [], None
        self.i += 2
        while True:
            cond = self.sequence(("then",))
            self.expect("then", "after the if condition")
            body = self.sequence(("elif", "else", "fi"))
            clauses.append((cond, body))
            kw = self.reserved("elif", "else", "fi")
            self.i += len(kw or "")
            if kw == "elif":
                continue
            if kw == "else":
                other = self.sequence(("fi",))
                self.expect("fi", "to close the if")
            elif kw is None:
                self.fail("an if without its fi; close it", self.i)
            return self.redirected(Node(line, "if", {"clauses": clauses, "else": other}))

    def for_(self, line: int) -> Node:
        self.i += 3
        self.blanks()
        if self.peek(2) == "((":
            self.i = self.closing("(", ")", self.i + 1)
            items, name = None, None
        else:
            name = "".join(p.text for p in self.word() or ())
            self.blanks(newlines=True)
            items = None
            if self.reserved("in"):
                self.i += 2
                items = []
                while True:
                    self.blanks()
                    if self.peek() in ";\n" or self.i >= len(self.s):
                        break
                    items.append(self.word())
        self.blanks()
        if self.peek() == ";":
            self.i += 1
        self.expect("do", "after the for list")
        body = self.sequence(("done",))
        self.expect("done", "to close the for loop")
        return self.redirected(Node(line, "for", {"name": name, "items": items, "body": body}))

    def case(self, line: int) -> Node:
        self.i += 4
        self.blanks()
        subject = self.word()
        self.expect("in", "after the case word")
        items = []
        while True:
            self.blanks(newlines=True)
            if self.reserved("esac"):
                self.i += 4
                return self.redirected(Node(line, "case", {"word": subject, "items": items}))
            if self.peek() == "(":
                self.i += 1
            patterns = []
            while True:
                self.blanks()
                patterns.append(self.word(stop="|)"))
                self.blanks()
                if self.peek() == "|":
                    self.i += 1
                    continue
                if self.peek() != ")":
                    self.fail("a case pattern without its ')'")
                self.i += 1
                break
            body = self.sequence(("esac",))
            if self.peek(2) == ";;":
                self.i += 2
            items.append((patterns, body))

    def cond(self, line: int) -> Node:
        """[[ ... ]]: words and operators up to ]] (no word splitting inside, bash's rule)."""
        self.i += 2
        tokens: list = []
        while True:
            self.blanks(newlines=True)
            if self.s.startswith("]]", self.i):
                self.i += 2
                return Node(line, "cond", {"tokens": tokens})
            for op in ("&&", "||", "(", ")", "<", ">", "!"):
                if self.s.startswith(op, self.i) and (op != "!" or self.peek(2)[1:] in " \t"):
                    tokens.append(op)
                    self.i += len(op)
                    break
            else:
                regex = bool(tokens) and plain(tokens[-1]) == "=~"
                w = self.regex_word() if regex else self.word()
                if w is None:
                    self.fail("an unclosed [[ ]]; close it")
                tokens.append(w)

    def regex_word(self) -> Word:
        """The right of =~: a word in which ( ) and | are the regex's own (bash reads them so)."""
        start = self.i
        depth = 0
        while self.i < len(self.s):
            c = self.peek()
            if c == "(":
                depth += 1
            elif c == ")":
                if depth == 0:
                    break
                depth -= 1
            elif c in " \t\n" and depth == 0:
                break
            self.i += 1
        return (Part("lit", self.s[start : self.i]),)
