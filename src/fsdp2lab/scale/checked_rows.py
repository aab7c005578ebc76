"""The plan's time against the runs its time tests check (tests/test_scale_published.py,
tests/test_hf_plan.py): each run's tokens/s per GPU as planned and as published or measured, as
``scripts/plan_time_table.py`` prints them (docs/scale.md's time table).

``MODEL_ERROR``, the largest of the rows' errors, is the error the time model has shown:
``fsdp2lab plan --search`` calls layouts within it of each other a tie. The planned figures are
the model's today: tests/test_hf_plan.py runs the script and fails where one has moved (then
update them here from its output).
"""

from __future__ import annotations

# run -> (planned, published or measured) tokens/s per GPU
ROWS = {
    "table 1, FSDP": (6571, 5762),
    "table 1, FSDP + compile": (8029, 6667),
    "table 3, FSDP": (6282, 5605),
    "table 3, FSDP + compile": (7599, 6514),
    "Llama 2 13B, 64 A100": (2228, 1904),
    "H200 1.2B shape, 16 layers": (49578, 44113),
    "H200 1.2B shape, 16 layers, compiled": (58433, 48415),
    "H200 1.2B shape, 4 layers": (117720, 102861),
}
MODEL_ERROR = max(abs(planned / run - 1) for planned, run in ROWS.values())
