"""Measurement on one rank: communication, memory and the timeline (DESIGN.md section 4)."""
