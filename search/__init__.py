"""Running candidates on the GPU: the evaluator (`evaluator.py`, gates in `gates.py`, timing in `timing.py`,
launchers in `launcher.py`) and the benchmark driver behind `l2ir bench` (`bench.py`)."""
