"""Collection rules for the whole repository (``--doctest-modules`` imports every module)."""

from __future__ import annotations

import importlib.util

# The Stable-Baselines3 adapter and its peer-suite plugin import SB3, an optional extra.
collect_ignore = (
    ["clusterenv/sb3.py", "tests/peers/sb3_harness.py"] if importlib.util.find_spec("stable_baselines3") is None else []
)
