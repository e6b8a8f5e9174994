"""Measurement on one rank: communication, memory and the timeline (ARCHITECTURE.md)."""
