"""bench/device.sh's recipes name sweep configurations by hand, and device time is scarce: every family and case
they name must exist before a recipe reaches a GPU."""

import re
from pathlib import Path

import pytest

DEVICE_SH = Path(__file__).resolve().parents[1] / "bench" / "device.sh"
TEXT = DEVICE_SH.read_text()
FAMILIES = sorted(set(re.findall(r"--family (\S+)", TEXT)))
# --case SHAPE:SWEEP:CONFIG, and the same triples listed in the script's variables (WIDE_EXTRA).
CASES = sorted(set(re.findall(r"\b(\d+x\d+x\d+):([a-z0-9_]+):([A-Za-z0-9_]+)", TEXT)))


def test_the_recipes_name_families_and_cases():
    assert len(FAMILIES) > 10 and len(CASES) > 20


@pytest.mark.parametrize("spec", FAMILIES)
def test_every_family_a_recipe_names_exists(spec):
    from l2ir.cli import _bench_family

    backend, sweep, configs = _bench_family(spec.strip("'\""))
    assert configs, spec


@pytest.mark.parametrize("shape,sweep,config", CASES, ids=[":".join(c) for c in CASES])
def test_every_case_a_recipe_names_exists(shape, sweep, config):
    from l2ir.search.sweeps import load_sweep

    assert config in load_sweep(sweep), f"{shape}:{sweep}:{config}: no configuration '{config}' in sweep '{sweep}'"
