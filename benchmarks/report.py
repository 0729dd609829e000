"""What every benchmark report states first: the command that produced it."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["command_line"]

BENCHMARKS = Path(__file__).resolve().parent


def command_line(script: str, drop: Iterable[str] = ()) -> str:
    """``python benchmarks/<script> <this run's arguments>``, as a reader would type it to reproduce the report.

    Args:
        script: the benchmark's ``__file__`` (here or in ``probes/``).
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
