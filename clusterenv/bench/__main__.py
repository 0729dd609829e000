"""``python -m clusterenv.bench``: the command line of :mod:`clusterenv.bench.cli`."""

from __future__ import annotations

from clusterenv.bench.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
