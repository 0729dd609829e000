"""The worker tier: the process that steps a slice of the envs (``python -m clusterenv.worker``).

The process and its mailbox (``process``), env child processes (``env_processes``,
``env_process``), local-policy commands (``local_policy``), the shared step path's handlers
(``shared_steps``), and its heartbeat and watchdog (``heartbeat``); it steps its slice with
the stepping tier's vector env. It imports the wire, policy and stepping tiers, never the
learner or the launchers.
"""

__all__: list[str] = []
