"""Results (orchestration, rung 3): what a run (RunResult), a measurement of the user's code
(Measurement) and a dry run return, and the views they share (tables, trace, summary)."""
