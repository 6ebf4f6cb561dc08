"""Tests that run on the session-scoped rank pools (the ``pools`` fixture, tests/conftest.py)."""
