"""Bash's conditional expressions (GNU Bash manual, "Bash Conditional Expressions"): [[ ]] over
words and `[` / `test` over fields, for labkit/config/jobs/shell/. Three-valued: True, False, or
None where the answer needs what labkit never looks at (a file, a command's output)."""

from __future__ import annotations

import fnmatch
import re

from labkit.config.jobs.shell.arith import arithmetic
from labkit.config.jobs.shell.words import plain

FILE_TESTS = set("-a -b -c -d -e -f -g -h -k -p -r -s -t -u -w -x -G -L -N -O -S".split())
"""Tests on files: unknown (labkit looks at no file system)."""
UNARY = FILE_TESTS | {"-z", "-n", "-v"}
NUMERIC = {"-eq": "==", "-ne": "!=", "-lt": "<", "-le": "<=", "-gt": ">", "-ge": ">="}
BINARY = {"=", "==", "!=", "=~", "<", ">", "-nt", "-ot", "-ef", *NUMERIC}


def both(a, b, op: str) -> bool | None:
    """and / or over three values."""
    if op == "&&":
        return False if False in (a, b) else None if None in (a, b) else True
    return True if True in (a, b) else None if None in (a, b) else False


def negate(a):
    return None if a is None else not a


class Conditions:
    def __init__(self, x, line: int, fail):
        self.x, self.line, self.fail = x, line, fail

    def unary(self, op: str, a: str) -> bool | None:
        if op == "-v":
            return a in self.x.vars
        if op in FILE_TESTS:
            return None
        if self.x.why(a):
            return None
        return (a == "") if op == "-z" else (a != "")

    def binary(self, op: str, a: str, b: str, pattern: bool, arith: bool) -> bool | None:
        if self.x.why(a) or self.x.why(b) or op in ("-nt", "-ot", "-ef"):
            return None
        if op in NUMERIC:
            if arith:  # [[ ]] reads -eq's operands as arithmetic; [ ] as whole numbers
                a, b = (arithmetic(v, self.x.number, self.line, self.fail) for v in (a, b))
            else:
                try:
                    a, b = int(a), int(b)
                except ValueError:
                    self.fail(self.line, f"[ {a} {op} {b} ]: {op} compares whole numbers")
            return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[NUMERIC[op]]
        if op == "=~":
            return re.search(b, a) is not None
        if op in ("<", ">"):
            return a < b if op == "<" else a > b
        same = fnmatch.fnmatchcase(a, b) if pattern else a == b
        return same if op in ("=", "==") else not same

    # -- [[ ]] ------------------------------------------------------------------------------------
    def double(self, tokens: list) -> bool | None:
        """[[ tokens ]]: words stay whole; the right of == and != is a pattern unless quoted."""
        at = [0]

        def peek():
            return tokens[at[0]] if at[0] < len(tokens) else None

        def op_of(t):
            return t if isinstance(t, str) else plain(t)

        def value(t) -> str:
            return self.x.joined(t, self.line)

        def pattern(t) -> str:
            # quoted parts match themselves: their glob characters escaped
            out = []
            for p in t:
                v = self.x.joined((p,), self.line)
                out.append(re.sub(r"([*?\[])", r"[\1]", v) if p.quoted else v)
            return "".join(out)

        def primary():
            t = peek()
            if t is None:
                self.fail(self.line, "[[ ]] ends too early")
            at[0] += 1
            if op_of(t) == "!":
                return negate(primary())
            if op_of(t) == "(":
                v = expr()
                at[0] += 1  # ')'
                return v
            nxt = peek()
            if op_of(t) in UNARY and nxt is not None and op_of(nxt) not in ("&&", "||", ")"):
                at[0] += 1
                return self.unary(op_of(t), value(nxt))
            if nxt is not None and op_of(nxt) in BINARY:
                at[0] += 1
                right = peek()
                at[0] += 1
                op = op_of(nxt)
                if op == "=~":
                    return self.binary(op, value(t), value(right), False, True)
                if op in ("=", "==", "!="):
                    return self.binary(op, value(t), pattern(right), True, True)
                return self.binary(op, value(t), value(right), False, True)
            return self.unary("-n", value(t))

        def conj():
            v = primary()
            while op_of(peek() or "") == "&&":
                at[0] += 1
                v = both(v, primary(), "&&")
            return v

        def expr():
            v = conj()
            while op_of(peek() or "") == "||":
                at[0] += 1
                v = both(v, conj(), "||")
            return v

        return expr()

    # -- [ ] and test --------------------------------------------------------------------------------
    def single(self, args: list[str]) -> bool | None:
        """POSIX test over fields: decided by the number of arguments up to 4, -a / -o beyond."""
        n = len(args)
        if n == 0:
            return False
        if n == 1:
            return self.unary("-n", args[0])
        if n == 2:
            if args[0] == "!":
                return negate(self.single(args[1:]))
            if args[0] in UNARY:
                return self.unary(args[0], args[1])
            self.fail(self.line, f"[ {' '.join(args)} ]: {args[0]} is not a unary test")
        if n == 3:
            if args[1] in BINARY - {"=~"}:
                return self.binary(args[1], args[0], args[2], False, False)
            if args[1] in ("-a", "-o"):
                return both(self.single(args[:1]), self.single(args[2:]), "&&" if args[1] == "-a" else "||")
            if args[0] == "!":
                return negate(self.single(args[1:]))
            if args[0] == "(" and args[2] == ")":
                return self.single(args[1:2])
        if n == 4 and args[0] == "!":
            return negate(self.single(args[1:]))
        for joiner, op in (("-o", "||"), ("-a", "&&")):  # -a binds tighter than -o
            if joiner in args[1:-1]:
                k = len(args) - 1 - args[::-1].index(joiner)
                return both(self.single(args[:k]), self.single(args[k + 1 :]), op)
        self.fail(self.line, f"[ {' '.join(args)} ] is not a test labkit reads; write it with [[ ]]")
        return None
