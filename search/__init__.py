"""Running candidates on the GPU. `pipeline.py` is the one path every candidate takes (legalize, dedupe, lower,
compile, evaluate, record); `evaluator.py` runs the gates (`gates.py`) and the timing (`timing.py`) in a worker that
owns the GPU; `records.py` and `db.py` keep the measurements; `report.py` summarizes them; `preflight.py` checks the
machine before any GPU work; `sweeps/` holds named kernel sweeps as .l2 files; `bench.py` drives `l2ir bench`;
`loop.py` is the search behind `l2ir tune`."""
