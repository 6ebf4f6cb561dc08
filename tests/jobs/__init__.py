"""Tests that start fresh processes per test: fault jobs, torchrun, the soak, the docs."""
