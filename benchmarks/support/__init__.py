"""What the benchmark scripts share and users do not run: envs, report writing, bare floor loops, step-path counts.

The scripts import these as ``support.<module>`` (a script's folder, ``benchmarks/``, is first on
its ``sys.path``; the probes put it there), and their workers, which inherit that path, unpickle
``support.bench_envs``'s envs by the same name. From the repository root they are
``benchmarks.support.<module>`` (``python -m clusterenv.bench --entry-point
benchmarks.support.bench_envs:BurnEnv``).
"""
