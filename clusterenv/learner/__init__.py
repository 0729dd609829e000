"""The learner tier: the ``ClusterEnv`` vector env and everything that runs in the training process.

The VectorEnv (``vector_env``, built by ``building``) and its batch buffers (``step_buffers``), the worker pool
(``pool``, holding its parts ``membership`` and ``recovery``; what its commands mean on a
loss in ``commands``), first-ready batches (``first_ready``), the learner's heartbeat monitor,
local-policy rollouts (``rollouts`` loads both modes, ``lockstep_rollouts`` and ``prefetched_rollouts``, over
their shared base ``runner_base``; ``rollout_batch``), and the
checks of user input (``validation``). Workers never import it.
"""

__all__: list[str] = []
