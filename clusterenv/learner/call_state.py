"""``CallState``: the one call a ``ClusterEnv`` has pending, kept as ``AsyncVectorEnv`` keeps it.

Gymnasium's async API allows one call at a time (``reset_async`` then ``reset_wait``,
``step_async`` then ``step_wait``, ``call_async`` then ``call_wait``). Another call while one is
pending raises ``AlreadyPendingCallError``, a wait without its call ``NoAsyncCallError``, with
the states and messages ``AsyncVectorEnv`` uses, so that code catching them works unchanged.
An extension (a prefetching ``PolicyRunner``) may hold the call; the errors then name it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError
from gymnasium.vector.async_vector_env import AsyncState

__all__ = ["CallState"]


class CallState:
    """What a ``ClusterEnv``'s pending call is (an ``AsyncState``), who holds it, and whose replies it waits for."""

    def __init__(self) -> None:
        #: The pending call (``DEFAULT``: none).
        self.state = AsyncState.DEFAULT
        #: An extension holding the pending call (a prefetching runner).
        self.holder: str | None = None
        #: The workers whose replies the pending call waits for.
        self.pending: list[int] = []

    def check_free(self, name: str, busy: list[int]) -> None:
        """Refuse a call of method ``name`` while one is pending, or while the ``busy`` workers' envs are in flight."""
        if busy:
            raise AlreadyPendingCallError(
                f"Calling `{name}` while {len(busy)} workers' envs are in "
                "flight from async_reset()/send(): recv() them all first.",
                "step",
            )
        if self.state != AsyncState.DEFAULT:
            if self.holder is not None:
                raise AlreadyPendingCallError(f"Calling `{name}` while the envs are held by {self.holder}.", "call")
            raise AlreadyPendingCallError(
                f"Calling `{name}` while waiting for a pending call to `{self.state.value}` to complete.",
                str(self.state.value),
            )

    def check_pending(self, state: AsyncState, name: str) -> None:
        """Refuse method ``name``, a wait, unless the pending call is ``state``."""
        if self.state != state:
            raise NoAsyncCallError(f"Calling `{name}` without any prior call to `{state.value}_async`.", state.value)

    @contextlib.contextmanager
    def held(self, state: AsyncState, holder: str | None = None) -> Iterator[None]:
        """The call ``state`` is pending (held by ``holder``) while the block runs; none once it ends, however."""
        self.state, self.holder = state, holder
        try:
            yield
        finally:
            self.state, self.holder = AsyncState.DEFAULT, None
