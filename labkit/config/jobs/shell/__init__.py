"""A launch script evaluated as bash would evaluate what its launch needs, running nothing
(labkit/config/jobs/megatron/ reads the launch's words).

    found = launch(text, args=["/ckpt", "/tokenizer"], env={"SLURM_NNODES": "4"})
    found.words    # ['torchrun', '--nproc_per_node', '8', ..., 'pretrain_gpt.py', '--num-layers', '32', ...]

Why a small evaluator and not a library: Python's standard library has `shlex`, which splits words
and knows nothing of variables, arrays, arithmetic or `if`. The maintained parser of bash for Python,
bashlex (0.18, a port of bash's own parser), is GPL-3.0-or-later against labkit's Apache-2.0, parses
without evaluating, and refuses what these scripts are written with (`A=(a b)` and `[[ $X == y ]]`:
ParsingError; `$((1+2))`, `case`: NotImplementedError); and the config rung imports the standard
library alone (ARCHITECTURE.md). What a launch needs is the values of its words: the grammar of
shell/parse.py, bash's expansions in shell/expand.py, its tests in shell/cond.py, and the running here.

What it evaluates, as bash does (GNU Bash manual, "Shell Expansions", "Bash Conditional Expressions"):
  variables, positional arguments ($1.., $#, $@, $*: `args`, empty when not given, as a user running
  the script bare) and the environment (`env`; a variable neither sets is empty); ${X:-w} ${X-w}
  ${X:=w} ${X=w} ${X:+w} ${X+w} ${X:?m} ${#X} ${X%p} ${X%%p} ${X#p} ${X##p} ${X/p/r} ${X:o:n};
  arrays (A=(...), A+=(...), ${A[@]}, "${A[@]}", ${A[*]}, ${A[i]}, ${#A[@]}); $(( )) and (( ))
  arithmetic; word splitting of unquoted expansions (IFS is space, tab, newline) and quote removal;
  [[ ]], [ ] and test on strings and numbers; if / elif / else, && and ||, case; export, declare,
  unset, shift, set --; functions, called where the script calls them; a loop whose condition is
  false on entry (it never runs).
What it never does: run a command (no mkdir, no torchrun, no $( ) or ``, no `source`), look at the
file system (a file test is unknown), expand a pathname pattern (bash leaves one that matches no
file as written; the scripts' patterns are arguments such as --moe-layer-freq [0]*3+[1]*58). A
command it does not run is taken to succeed (`mkdir -p x || exit 1` goes on), as on the machine the
script was written for; an `exit` under a test it cannot decide is taken not to happen.
What it cannot know becomes unknown; unknown is refused, with the line, only where the launch would
depend on it: a value from a command substitution in the launch's words, a variable set inside an
`if` whose test it cannot decide or inside a loop that runs.

The launch: the one command on the script's path with a Python script among its words (torchrun,
python -m torch.distributed.run, srun ... python): its words, expanded. A script that only builds the
command as a string for another command (an sbatch here-document running `bash -c "$CMD"`) has it in
a variable: then the variable's value, read as `bash -c` reads it.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from labkit.config.choices import ConfigError
from labkit.config.jobs.shell.arith import arithmetic
from labkit.config.jobs.shell.cond import Conditions
from labkit.config.jobs.shell.expand import Expander
from labkit.config.jobs.shell.parse import Node, Parser
from labkit.config.jobs.shell.words import plain

QUIET = {"echo", "printf", "cat", "mkdir", "cd", "ls", "rm", "touch", "cp", "mv", "tee", "sleep", "wait", "trap"}
"""Commands whose words can name a .py file without launching it (a message, a path)."""
SCRIPT = re.compile(r"\S+\.py")
"""A word that names a Python script: the training script of a launch."""


class _Exit(Exception):
    def __init__(self, line: int):
        self.line = line


class _Return(Exception):
    pass


@dataclass
class Found:
    """The launch a script would run."""

    words: list[str]
    """Its words, expanded: the launcher's, the script's path, the script's arguments."""
    line: int
    via: str = ""
    """'' for a command of the script; else the variable whose value holds it (run by another command)."""
    notes: list[str] = field(default_factory=list)
    """What was read past without being decided (a test on a file, a command substitution no launch uses)."""


class Runner:
    def __init__(self, args, env, name: str):
        self.x = Expander(args, env, name)
        self.name = name
        self.functions: dict[str, Node] = {}
        self.launches: list[tuple[int, list[str], str]] = []
        self.notes: list[str] = []
        self.via = ""

    def fail(self, line: int, what: str):
        raise ConfigError([f"{self.name} line {line}: {what}"])

    # -- what a command could change --------------------------------------------------------------
    def matters(self, nodes) -> int | None:
        """The line of the first command among `nodes` that could change what the launch reads (an
        assignment, unset, shift, set --, a function, source/eval, a possible launch); None if none."""
        for n in nodes if isinstance(nodes, list) else [nodes]:
            d = n.data
            if n.kind == "simple":
                first = plain(d["words"][0]) if d["words"] else None
                if d["assigns"] or d["declared"] or first in ("unset", "shift", "source", ".", "eval"):
                    return n.line
                if first == "set" and any(plain(w) == "--" for w in d["words"]):
                    return n.line
                if first not in QUIET | {"exit", "return", "true", "false", ":", "[", "test", "set", "export"}:
                    if any(any(p.kind != "lit" for p in w) or SCRIPT.search(plain(w) or "") for w in d["words"]):
                        return n.line
                    if first in self.functions:
                        return n.line
            elif n.kind == "function":
                return n.line
            else:
                inner = []
                for key in ("body", "cond", "else", "commands"):
                    inner += d.get(key) or []
                for cond, body in d.get("clauses", []):
                    inner += cond + body
                for _, body in d.get("items", []) if n.kind == "case" else []:
                    inner += body
                inner += [x for _, x in d.get("items", [])] if n.kind == "andor" else []
                found = self.matters([x for x in inner if isinstance(x, Node)])
                if found:
                    return found
        return None

    def undecided(self, line: int, what: str, rest) -> None:
        """A test labkit cannot decide: harmless if nothing after it changes the launch, else refused."""
        at = self.matters(rest)
        if at is not None:
            self.fail(
                line,
                f"{what} cannot be decided without running the script, and line {at} under it changes what "
                "the launch reads; give the values it tests (env=, script_args=) or write the launch out",
            )
        self.notes.append(f"line {line}: {what}: not decided; nothing under it changes the launch")

    # -- running ------------------------------------------------------------------------------------
    def run(self, nodes: list[Node]) -> bool | None:
        status: bool | None = True
        for n in nodes:
            status = self.node(n)
        return status

    def node(self, n: Node) -> bool | None:
        d = n.data
        if n.kind == "simple":
            return self.simple(n)
        if n.kind == "andor":
            status = self.node(d["items"][0][1])
            for op, item in d["items"][1:]:
                if status is None:
                    self.undecided(n.line, f"the status before {op!r}", [item])
                    continue
                if (op == "&&") == status:
                    status = self.node(item)
            return status
        if n.kind == "pipeline":
            for c in d["commands"]:
                status = self.node(c)
            return (not status if status is not None else None) if d["negated"] else status
        if n.kind == "if":
            return self.if_(n)
        if n.kind in ("while", "until"):
            status = self.run(d["cond"])
            runs = status if n.kind == "while" or status is None else not status
            if runs is False:
                return True
            at = self.matters(d["body"])
            if at is not None:
                self.fail(n.line, f"a {n.kind} loop that runs changes what the launch reads (line {at}); labkit "
                          "does not iterate: write the values out")  # fmt: skip
            self.notes.append(f"line {n.line}: a {n.kind} loop; nothing in it changes the launch")
            return True
        if n.kind == "for":
            at = self.matters(d["body"])
            if at is not None:
                self.fail(n.line, f"a for loop changes what the launch reads (line {at}); labkit does not iterate: "
                          "write the values out")  # fmt: skip
            return True
        if n.kind == "case":
            return self.case(n)
        if n.kind == "group":
            return self.run(d["body"])
        if n.kind == "subshell":  # its assignments stay inside it
            saved = (dict(self.x.vars), list(self.x.args))
            try:
                return self.run(d["body"])
            finally:
                self.x.vars, self.x.args = saved
        if n.kind == "function":
            self.functions[d["name"]] = d["body"]
            return True
        if n.kind == "cond":
            return self.cond(d["tokens"], n.line)
        if n.kind == "arith":
            return arithmetic(self.x.dollars(d["expr"], n.line), self.x.number, n.line, self.fail) != 0
        self.fail(n.line, f"{n.kind} is not read")
        return None

    def if_(self, n: Node) -> bool | None:
        clauses = n.data["clauses"]
        for k, (cond, body) in enumerate(clauses):
            status = self.run(cond)
            if status is None:
                rest = [body] + [c + b for c, b in clauses[k + 1 :]] + [n.data["else"] or []]
                self.undecided(cond[0].line if cond else n.line, "the test of an if", [x for r in rest for x in r])
                return None
            if status:
                return self.run(body)
        return self.run(n.data["else"] or [])

    def case(self, n: Node) -> bool | None:
        subject = self.x.joined(n.data["word"], n.line)
        if self.x.why(subject):
            self.undecided(n.line, f"case on {self.x.why(subject)}", [b for _, body in n.data["items"] for b in body])
            return None
        for patterns, body in n.data["items"]:
            if any(fnmatch.fnmatchcase(subject, self.x.joined(p, n.line)) for p in patterns):
                return self.run(body)
        return True

    def simple(self, n: Node) -> bool | None:
        d, line = n.data, n.line
        if not d["words"]:
            for a in d["assigns"]:
                self.x.assign(a, line)
            return True
        try:
            words = self.x.all_fields(d["words"], line)
        except ConfigError:
            if self.matters([Node(line, "simple", {**d, "assigns": []})]) is None:
                self.notes.append(f"line {line}: a command not expanded (labkit never runs it)")
                return True
            raise
        if not words:
            return True
        cmd, args = words[0], words[1:]
        if cmd in ("export", "declare", "typeset", "local", "readonly"):
            for a in d["declared"]:
                self.x.assign(a, line)
            return True
        if cmd == "unset":
            for name in args:
                self.x.vars.pop(name, None)
            return True
        if cmd == "shift":
            k = int(args[0]) if args else 1
            self.x.args = self.x.args[k:]
            return True
        if cmd == "set":
            if "--" in args:
                self.x.args = args[args.index("--") + 1 :]
            return True
        if cmd in ("true", ":"):
            return True
        if cmd == "false":
            return False
        if cmd in ("[", "test"):
            return self.test(args[:-1] if cmd == "[" and args[-1:] == ["]"] else args, line)
        if cmd in ("source", ".", "eval"):
            self.fail(line, f"`{cmd}` would run other code; labkit never runs or sources anything: give the "
                      "values it sets (env=) or write them in the script")  # fmt: skip
        if cmd == "exit":
            raise _Exit(line)
        if cmd == "return":
            raise _Return
        if cmd in self.functions:
            saved = self.x.args
            self.x.args = args
            try:
                return self.node(self.functions[cmd])
            except _Return:
                return True
            finally:
                self.x.args = saved
        if cmd not in QUIET and any(SCRIPT.fullmatch(w) for w in words):
            # a launch inside a variable's value is reported at the line that assigned it
            self.launches.append((self.x.assigned_at[self.via] if self.via else line, words, self.via))
        return True  # a command labkit does not run is taken to succeed, as where the script was written

    def cond(self, tokens: list, line: int) -> bool | None:
        return Conditions(self.x, line, self.fail).double(tokens)

    def test(self, args: list[str], line: int) -> bool | None:
        return Conditions(self.x, line, self.fail).single(args)

    def in_values(self) -> None:
        """No command launches: the launch may be a string another command runs (sbatch's here-document
        running `bash -c "$CMD"`); each variable whose value names a Python script, read as bash -c reads it."""
        for name in sorted(self.x.assigned_at, key=self.x.assigned_at.get):
            value = self.x.vars.get(name)
            if not isinstance(value, str) or not SCRIPT.search(value) or self.x.why(value):
                continue
            self.via = name
            try:
                self.run(Parser(value, f"{self.name} (the value of {name}, line {self.x.assigned_at[name]})").parse())
            except _Exit:
                pass
        self.via = ""


def launch(text: str, args=(), env: dict | None = None, name: str = "the script") -> Found:
    """The launch `text` would run with positional arguments `args` and environment `env`
    (module docstring); a ConfigError naming the line for what cannot be read."""
    r = Runner(args, env, name)
    exited = None
    try:
        r.run(Parser(text, name).parse())
    except _Exit as e:
        exited = e.line
    if not r.launches:
        r.in_values()
    if not r.launches:
        where = f"; it exits at line {exited} first" if exited else ""
        raise ConfigError(
            [f"{name} launches no Python script (no torchrun ... pretrain_gpt.py){where}; give the arguments (args=)"]
        )
    if len(r.launches) > 1:
        lines = "; ".join(
            f"line {line}: {next(w for w in words if SCRIPT.fullmatch(w))}" for line, words, _ in r.launches
        )
        raise ConfigError([f"{name} launches {len(r.launches)} Python scripts ({lines}); labkit reads one launch: "
                           "give the arguments of the one you mean (args=)"])  # fmt: skip
    line, words, via = r.launches[0]
    for w in words:
        why = r.x.why(w)
        if why:
            raise ConfigError([f"{name} line {line}: a word of the launch holds the output of {why}; labkit "
                               "never runs a command: write the value in the script, or give it (env=)"])  # fmt: skip
    return Found(words, line, via, r.notes)
