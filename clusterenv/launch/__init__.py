"""Launchers: how worker processes start, on this host (``launchers``) or through Ray (``ray``).

The learner's pool starts workers through a launcher; launchers import the wire tier only
(the Ray actor imports the worker inside its own process).
"""

__all__: list[str] = []
