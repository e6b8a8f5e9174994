"""Real text: a small byte-level model learns the Shakespeare corpus on 4 engines, in minutes.

    python benchmarks/text.py                 # 4 CPU engines, dp=4, STEPS steps
    python benchmarks/text.py --steps 40

A model of GPT-2's shape at a small width (6 layers x 256, arch 'gpt' until the GPT-2 / Llama
families land) trains with data='text' (labkit/layout/text.py); after the last step the ranks
compute the validation loss on the held-out split. The goal: a validation loss below the
corpus's byte-unigram entropy (the best loss of a model that ignores context, in nats) within 5
minutes of training on this machine. Prints the steps, the time, the validation loss against
the entropy and against the untrained model's, and a sample before and after.
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import machine, table  # noqa: E402

from labkit import Lab, ModelConfig, ParallelConfig, reference  # noqa: E402
from labkit.layout import text  # noqa: E402

MODEL = ModelConfig(layers=6, hidden=256, heads=8, ffn=1024, vocab=256, seq=128)
LAYOUT = ParallelConfig(dp=4, global_batch=16)
STEPS = 250
BUDGET_S = 300.0
PROMPT = "ROMEO.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()

    entropy = text.unigram_entropy()
    before = reference(MODEL, steps=0, global_batch=LAYOUT.global_batch, data="text")
    t0 = time.perf_counter()
    with Lab(engines=LAYOUT.world, progress=False) as lab:
        started = time.perf_counter() - t0
        res = lab.run(LAYOUT, model=MODEL, steps=args.steps, data="text", timeout=2 * BUDGET_S)
    losses = ", ".join(f"{i}: {res.losses[i]:.3f}" for i in range(0, args.steps, max(1, args.steps // 10)))
    print(f"# text: {MODEL} on {LAYOUT.world} engines, {LAYOUT}")
    print(f"machine: {machine()}")
    print(
        table(
            [
                ("parameters", f"{MODEL.num_params():,}"),
                ("tokens per step", f"{LAYOUT.global_batch * MODEL.seq:,} bytes"),
                ("Lab start", f"{started:.1f} s"),
                ("steps", str(args.steps)),
                ("training (lab.run, validation included)", f"{res.wall_seconds:.1f} s (budget {BUDGET_S:.0f} s)"),
                ("training loss by step", losses + f", {args.steps - 1}: {res.losses[-1]:.3f}"),
                ("validation loss, untrained", f"{before.validation_loss:.3f} nats"),
                ("validation loss, trained", f"{res.validation_loss:.3f} nats"),
                ("byte-unigram entropy", f"{entropy:.3f} nats"),
                (
                    "below the entropy in budget",
                    "yes" if res.validation_loss < entropy and res.wall_seconds < BUDGET_S else "NO",
                ),
            ]
        )
    )
    print(f"\nsample before (temperature 0.8, seed 0):\n{PROMPT}{before.generate(PROMPT, 300)}")
    print(f"\nsample after (temperature 0.8, seed 0):\n{PROMPT}{res.generate(PROMPT, 300)}")


if __name__ == "__main__":
    main()
