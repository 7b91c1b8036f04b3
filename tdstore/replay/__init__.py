"""Replay-buffer services kept on the server, beside a store's ring buffer (issue 26).

- :mod:`tdstore.replay.priorities`: proportional prioritized sampling (``enable_priorities``,
  ``sample(prioritized=True)``, ``update_priority``);
- :mod:`tdstore.replay.rate_limit`: Reverb's rate limiters (``set_rate_limit``);
- :mod:`tdstore.replay.slices`: trajectory slices chosen on the server (``sample_slices``);
- :mod:`tdstore.replay.prefetch`: :class:`Prefetcher`, samples drawn ahead by threads.

The store's methods delegate to these modules, which take the store: they are
collaborators of ``TensorDictStore``, not bases.
"""

from tdstore.replay.prefetch import Prefetcher

__all__ = ["Prefetcher"]
