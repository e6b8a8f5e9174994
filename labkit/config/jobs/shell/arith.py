"""Bash's integer arithmetic, $(( )) and (( )) (GNU Bash manual, "Shell Arithmetic"), for
labkit/config/jobs/shell/: 64-bit integers, names read as variables ($X or X; empty is 0), the
operators ** * / % + - << >> < <= > >= == != & ^ | && || ?: ! ~ and parentheses; / and % truncate
toward zero as C does. Assignment operators (=, +=, ++, ...) are refused: a launch's arithmetic
computes values, and a side effect hidden in one is what the reader would have to guess.
"""

from __future__ import annotations

import re

TOKEN = re.compile(
    r"\s*(0[xX][0-9a-fA-F]+|\d+#\w+|\d+|[A-Za-z_]\w*|\$\{?[A-Za-z_]\w*\}?"  # numbers, names
    r"|\*\*|<<|>>|<=|>=|==|!=|&&|\|\||\+\+|--|[-+*/%()<>!~&^|?:=])"  # operators, longest first
)
BINARY = [  # lowest precedence first
    ("||",),
    ("&&",),
    ("|",),
    ("^",),
    ("&",),
    ("==", "!="),
    ("<", "<=", ">", ">="),
    ("<<", ">>"),
    ("+", "-"),
    ("*", "/", "%"),
]


def _c_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def apply(op: str, a: int, b: int) -> int:
    if op in ("/", "%") and b == 0:
        raise ZeroDivisionError
    return {
        "||": lambda: int(bool(a) or bool(b)),
        "&&": lambda: int(bool(a) and bool(b)),
        "|": lambda: a | b,
        "^": lambda: a ^ b,
        "&": lambda: a & b,
        "==": lambda: int(a == b),
        "!=": lambda: int(a != b),
        "<": lambda: int(a < b),
        "<=": lambda: int(a <= b),
        ">": lambda: int(a > b),
        ">=": lambda: int(a >= b),
        "<<": lambda: a << b,
        ">>": lambda: a >> b,
        "+": lambda: a + b,
        "-": lambda: a - b,
        "*": lambda: a * b,
        "/": lambda: _c_div(a, b),
        "%": lambda: a - b * _c_div(a, b),
        "**": lambda: a**b,
    }[op]()


def arithmetic(text: str, number, line: int, fail) -> int:
    """The value of `text`; number(name, line) -> a variable's value; fail(line, why) raises."""
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m or not m.group(1):
            fail(line, f"$(( {text} )): {text[pos:]!r} is not arithmetic labkit reads")
        tokens.append(m.group(1))
        pos = m.end()
    if any(t in ("=", "++", "--") for t in tokens):
        fail(line, f"$(( {text} )) assigns inside arithmetic; write the value in its own assignment")
    at = [0]

    def peek():
        return tokens[at[0]] if at[0] < len(tokens) else None

    def take():
        at[0] += 1
        return tokens[at[0] - 1]

    def primary() -> int:
        t = take() if peek() is not None else None
        if t is None:
            fail(line, f"$(( {text} )) ends too early")
        if t == "(":
            v = ternary()
            if take() != ")":
                fail(line, f"$(( {text} )): a ')' is missing")
            return v
        if t in ("-", "+", "!", "~"):
            v = unary()
            return {"-": -v, "+": v, "!": int(not v), "~": ~v}[t]
        if t[0].isdigit():
            if "#" in t:
                base, digits = t.split("#")
                return int(digits, int(base))
            return int(t, 0) if t.lower().startswith("0x") else int(t, 8 if len(t) > 1 and t[0] == "0" else 10)
        return number(t.strip("${}"), line)

    def unary() -> int:
        v = primary()
        if peek() == "**":  # right-associative, above the multiplications
            take()
            return apply("**", v, unary())
        return v

    def binary(level: int) -> int:
        if level == len(BINARY):
            return unary()
        v = binary(level + 1)
        while peek() in BINARY[level]:
            op = take()
            try:
                v = apply(op, v, binary(level + 1))
            except ZeroDivisionError:
                fail(line, f"$(( {text} )) divides by zero")
        return v

    def ternary() -> int:
        cond = binary(0)
        if peek() != "?":
            return cond
        take()
        a = ternary()
        if take() != ":":
            fail(line, f"$(( {text} )): '?' without ':'")
        b = ternary()
        return a if cond else b

    if not tokens:
        return 0
    value = ternary()
    if peek() is not None:
        fail(line, f"$(( {text} )): unexpected {peek()!r}")
    return value
