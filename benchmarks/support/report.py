"""What every benchmark report states first (the command that produced it), and where it is written."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["command_line", "machine", "write_report"]

BENCHMARKS = Path(__file__).resolve().parents[1]
#: Where every report goes, and where the documentation includes it from.
RESULTS_DIR = BENCHMARKS / "results"


def command_line(script: str, drop: Iterable[str] = ()) -> str:
    """``python benchmarks/<script> <this run's arguments>``, as a reader would type it to reproduce the report.

    Args:
        script: the benchmark's ``__file__`` (in ``benchmarks/`` or ``benchmarks/probes/``).
        drop: arguments left out because they do not change the results (``--plot-only``).
    """
    dropped = set(drop)
    return shlex.join(
        [
            "python",
            f"benchmarks/{Path(script).resolve().relative_to(BENCHMARKS).as_posix()}",
            *(a for a in sys.argv[1:] if a not in dropped),
        ]
    )


def machine() -> str:
    """The processor and the usable cores, as a report names the machine it ran on ("AMD EPYC 7B13, 2 cores")."""
    import os

    model = "unknown processor"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} usable cores"


def write_report(name: str, text: str, figures: Mapping[str, Any] | None = None) -> None:
    """Print a report's ``text`` and write it to ``results/NAME.md``; its raw ``figures``, if any, to ``NAME.json``."""
    print(text)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.md").write_text(text)
    if figures is not None:
        (RESULTS_DIR / f"{name}.json").write_text(json.dumps(figures, indent=1) + "\n")
