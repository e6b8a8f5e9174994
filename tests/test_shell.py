"""A launch script read as bash reads it (labkit/config/jobs/shell/), held to bash itself: each
snippet below ends in a launch, and bash, with `torchrun` defined as a function that prints its
arguments, says which words that launch gets; labkit's evaluator must give the same words without
running anything. Then its limits: what it cannot evaluate is refused with the line."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from labkit import ConfigError
from labkit.config.jobs.shell import launch

BASH = shutil.which("bash")

SNIPPETS = {
    "defaults": """
GPUS=${GPUS_PER_NODE:-8}; B=${GPUS:+set}; C=${NOPE-dash}; EMPTY=; D=${EMPTY:-colon}; E=${EMPTY-kept}
F=${LATER:=assigned}
torchrun --a $GPUS --b $B --c $C --d $D --e "$E" --f $F --g $LATER train.py
""",
    "arithmetic": """
NNODES=2; GPUS_PER_NODE=8
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES)); X=$(( (WORLD_SIZE + 3) / 2 % 5 ** 2 )); Y=$((WORLD_SIZE > 10 ? 1 : 0))
Z=$((-7 / 2)); M=$((-7 % 3)); H=$((0x10 + 010)); S=$((1 << 4 | 3)); L=$(( ! 0 && 2 || 0 ))
torchrun --nproc_per_node $GPUS_PER_NODE train.py $WORLD_SIZE $X $Y $Z $M $H $S $L
""",
    "arrays": """
DISTRIBUTED_ARGS=(
    --nproc_per_node 8   # a comment inside the array
    --nnodes 2 \\
    "--fp8-format hybrid"
)
DISTRIBUTED_ARGS+=(--tail "two words")
MORE=("${DISTRIBUTED_ARGS[@]}" --more)
EMPTY=()
torchrun ${DISTRIBUTED_ARGS[@]} train.py "${MORE[@]}" "${EMPTY[@]}" ${#MORE[@]} ${MORE[1]} "${MORE[*]}" $MORE
""",
    "tests": """
DTYPE="fp8"; N=3; NAME=model_v2
if [[ "$DTYPE" == "fp8" && $N -gt 2 ]]; then A=one; elif [[ $DTYPE == bf* ]]; then A=two; else A=three; fi
if [ "$N" -eq 3 -a -n "$NAME" ]; then B=yes; else B=no; fi
if [[ $NAME =~ ^model_v([0-9]+)$ ]]; then C=match; fi
if [[ -z "$UNSET" ]] || [[ "$NAME" != model* ]]; then D=empty; fi
if ! [ "$DTYPE" = "bf16" ]; then E=not; fi
[ -n "$NAME" ] && F=and || F=or
[[ $N -lt 2 ]] && G=lt || G=ge
torchrun train.py $A $B $C $D $E $F $G
""",
    "case": """
MODE=${MODE:-pretrain}
case $MODE in
    finetune|sft) LR=1e-5 ;;
    pre*) LR=3e-4 ;;
    *) LR=0 ;;
esac
torchrun train.py --lr $LR
""",
    "quotes": """
A='single $NOT'; B="double \\"q\\" \\$ $A"; C=$'tab\\there'; D=a"b c"'d'
torchrun train.py "$A" "$B" "$C" "$D" $D x\\ y
""",
    "strings": """
P=/path/to/ckpt.tar.gz
torchrun train.py ${P%/*} ${P##*/} ${P%%.*} ${P#*/} ${P/to/TO} ${P//t/T} ${P:1:4} ${#P}
""",
    "builtins": """
export TP=2
declare -a LIST=(x y)
OLD=gone; unset OLD
set -- first second third
shift
f() { SET_IN_F=$1; }
f "$2"
torchrun train.py --tp $TP ${LIST[1]} "$OLD" $1 $# "$@" $SET_IN_F "${@:2}" "${@:1:1}" ${LIST[@]:1}
""",
    "heredoc and skipped": """
cat <<EOF >/dev/null
$(date) ${ANYTHING}
EOF
while [[ $# -gt 0 ]]; do GONE=1; shift; done
for f in a b; do echo "$f" >/dev/null; done
torchrun train.py ${GONE:-never} 2>&1 | tee /dev/null
""",
}


def by_bash(text: str, args: list[str]) -> list[str]:
    """The launch's words as bash gives them: `torchrun` a function printing its arguments."""
    script = "torchrun() { printf '%s\\0' torchrun \"$@\"; }\n" + text
    out = subprocess.run([BASH, "-c", script, "script", *args], capture_output=True, check=True, text=True, env={})
    return out.stdout.split("\0")[:-1]


@pytest.mark.skipif(BASH is None, reason="bash is the oracle")
@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_the_launch_has_bash_s_words(name):
    args = ["ckpt", "tok"] if name == "builtins" else []
    want = by_bash(SNIPPETS[name], args)
    got = launch(SNIPPETS[name], args=args, name="script").words
    assert got == want
    assert want[0] == "torchrun" and "train.py" in want  # the oracle ran the launch


def test_positional_arguments_and_the_environment_as_given():
    text = 'CKPT=${1:-default}; N=${SLURM_NNODES:-1}\ntorchrun --nnodes $N train.py --save "$CKPT" --rest "${@:2}"\n'
    bare = launch(text).words
    assert bare[:3] == ["torchrun", "--nnodes", "1"] and bare[-3:] == ["--save", "default", "--rest"]
    given = launch(text, args=["/ckpt", "a", "b"], env={"SLURM_NNODES": "4"}).words
    assert given == ["torchrun", "--nnodes", "4", "train.py", "--save", "/ckpt", "--rest", "a", "b"]


def test_the_launch_may_be_a_string_another_command_runs():
    text = (
        'ARGS=(--num-layers 2 "--x y")\nCMD="cd /here; python pretrain_gpt.py ${ARGS[@]}"\n'
        'sbatch <<EOF\nbash -c "$CMD"\nEOF\n'
    )
    found = launch(text)
    assert (found.words, found.via, found.line) == (
        ["python", "pretrain_gpt.py", "--num-layers", "2", "--x", "y"],
        "CMD",
        2,
    )


@pytest.mark.parametrize(
    "text, error",
    [
        (
            "for n in 1 2; do NP=$n; done\ntorchrun --nproc_per_node $NP t.py\n",
            r"line 1: a for loop changes what the launch reads \(line 1\)",
        ),  # fmt: skip
        (
            "NP=$(nproc)\ntorchrun --nproc_per_node $NP t.py\n",
            r"line 2: a word of the launch holds the output of `nproc` \(line 1\)",
        ),  # fmt: skip
        ("source env.sh\ntorchrun t.py\n", r"line 1: `source` would run other code"),
        (
            "if [ -f /etc/cluster ]; then NP=8; fi\ntorchrun --nproc_per_node $NP t.py\n",
            r"line 1: the test of an if cannot be decided.*line 1 under it",
        ),  # fmt: skip
        ("X=${A@Q}\ntorchrun t.py $X\n", r"line 1: \$\{A@Q\} is not an expansion labkit reads"),
        ("torchrun a.py\ntorchrun b.py\n", r"launches 2 Python scripts \(line 1: a.py; line 2: b.py\)"),
        ("echo no launch here\n", r"launches no Python script"),
        ("A=(one two\ntorchrun t.py\n", r"line 1: A=\( \.\.\. \) is not closed by '\)'"),
        ("X=$((3 / 0))\ntorchrun t.py\n", r"line 1: \$\(\( 3 / 0 \)\) divides by zero"),
        ("exit 1\ntorchrun t.py\n", r"launches no Python script.*it exits at line 1 first"),
    ],
)
def test_what_it_cannot_evaluate_is_refused_with_the_line(text, error):
    with pytest.raises(ConfigError, match=error):
        launch(text, name="job.sh")


def test_what_it_cannot_decide_but_the_launch_does_not_need_is_noted():
    text = (
        "X=$(hostname)\nif [ ! -f pretrain_gpt.py ]; then echo missing; exit 1; fi\n"
        'mkdir -p "$(dirname $X)"\ntorchrun t.py\n'
    )
    found = launch(text)
    assert found.words == ["torchrun", "t.py"]
    assert any(n.startswith("line 2: the test of an if") for n in found.notes)
