"""``python -m clusterenv.worker``: run one worker (see ``clusterenv.worker.process``)."""

from clusterenv.worker.process import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
