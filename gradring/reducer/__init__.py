"""The Reducer and its collaborators.

``reducer.py`` holds the one ``Reducer`` class (the per-gradient hooks, the
launches, the finalize); the rest are pieces it owns or calls: the
iteration's states (``state.py``), the rebuild (``rebuild.py``), the owner
registry (``owners.py``), static_graph's first iteration
(``static_graph.py``), the end-of-backward callback (``engine_callback.py``)
and ``bucket_cap_mb="auto"``
(``autocap.py``).
"""

from gradring.reducer.reducer import CommHook, Reducer

__all__ = ["CommHook", "Reducer"]
