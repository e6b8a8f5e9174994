"""The theory's outputs on 2,400 fixed layouts and four planner searches equal the recorded ones to
the last bit (tests/theory_snapshot.py): a refactor of the theory, the configs or the layout keeps
every number. Re-record only in a commit that names the modelling change that moved them."""

from __future__ import annotations

import json

from theory_snapshot import PATH, outputs


def test_theory_outputs_equal_the_recorded_ones():
    with open(PATH) as f:
        want = json.load(f)
    got = outputs()
    assert set(got) == set(want), "the layouts sampled changed: the candidates or the validation moved"
    differ = sorted(k for k in want if got[k] != want[k])
    assert not differ, f"{len(differ)} of {len(want)} outputs changed, e.g.:\n" + "\n".join(differ[:10])
