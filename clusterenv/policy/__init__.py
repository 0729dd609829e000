"""Local policies: action heads, weight-sync strategies, and shipping a torch policy to workers.

Both sides import this tier: the learner to publish and measure, the worker to act and
decide when to pull. It imports only the wire tier.
"""

__all__: list[str] = []
