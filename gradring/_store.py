"""Where the DDP side finds gradring's store helpers (they live in ``comm/store.py``).

The reducer imports :func:`exchange_lists` from here on its error path.
"""

from __future__ import annotations

from gradring.comm.store import exchange_lists, group_store

__all__ = ["exchange_lists", "group_store"]
