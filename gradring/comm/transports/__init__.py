"""How the bytes of a collective move: the transports, and which ranks share a host.

``group`` makes and holds a group's transports; ``shm/`` (one host),
``torchdist`` (the process group's send/recv), ``hosts`` (shared memory per
host plus point-to-point across hosts) and
``topology`` (the one definition of "the same host").
"""
