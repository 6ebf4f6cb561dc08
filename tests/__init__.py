"""gradring's test suite, by what a test needs: unit/ (one process), ranks/ (the
session's rank pools), jobs/ (fresh processes per test), integrations/, multihost/;
shared helpers are imported as ``tests.support.<module>``."""
