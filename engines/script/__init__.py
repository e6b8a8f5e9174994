"""A user's training script under torchrun's contract, one child process per rank (its agent is the
engine's job, agent.py; the child's start is boot.py)."""
