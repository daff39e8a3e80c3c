import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

# `dev` (the default) is a quick local pass; CI selects `ci`, hundreds of generated cases per property, with
# L2IR_HYPOTHESIS_PROFILE=ci (so the README's test command and CI's are the same) or --hypothesis-profile ci.
# Interpreting a kernel takes tens of milliseconds, so no deadline and no too_slow health check; a strategy that
# filters too much still fails its health check.
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          print_blob=True)
settings.load_profile(os.environ.get("L2IR_HYPOTHESIS_PROFILE", "dev"))
