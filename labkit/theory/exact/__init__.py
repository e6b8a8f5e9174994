"""The exact per-rank theory: every rank's parameters, memory by category and comm rows of a
layout, to the byte (what `theory.estimate` returns and the engines' meters are held to)."""
