"""Stepping envs in one process, Gymnasium's way, recording what the learner needs.

A worker process steps its slice with :class:`~clusterenv.stepping.recording_env.RecordingVectorEnv`
(a ``SyncVectorEnv`` that records per-env infos), as do its env processes and the learner's own
slice (``ClusterEnv(learner_envs=k)``): so every per-env semantic (autoreset modes, seeding,
info batching, recovering from env errors) is one piece of code wherever the envs run.
"""

__all__: list[str] = []
