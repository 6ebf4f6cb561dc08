"""Helpers shared by the tests: rank pools, oracles, models, job harnesses."""
