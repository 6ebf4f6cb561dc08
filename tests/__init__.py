"""gradring's test suite; helpers are imported as ``tests.<module>``."""
