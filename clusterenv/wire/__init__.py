"""The wire tier: what the learner and its workers share, and all that either side may import.

Messages and their framing (``protocol``), authenticated sockets (``transport``), liveness
(``liveness``), observations through shared memory (``shared_memory``), unpickling what a
peer sends (``safe_pickle``), space values as leaf arrays (``leaves``), the checks both
vector envs make as ``SyncVectorEnv`` does (``contract``), and what a dead process leaves
behind (``cleanup``). Nothing here imports the learner, the worker or the launchers.
"""

__all__: list[str] = []
