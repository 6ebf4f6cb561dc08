"""Tests that run in one process: pure functions, the threaded transport, import checks."""
