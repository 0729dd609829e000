"""The worker tier: the process that steps a slice of the envs (``python -m clusterenv.worker``).

The process and its mailbox (``process``), the vector env it steps its slice with
(``recording_env``), env child processes (``env_processes``, ``env_process``), local-policy
commands (``local_policy``), and its heartbeat and watchdog (``heartbeat``). It imports
the wire and policy tiers, never the learner or the launchers.
"""

__all__: list[str] = []
