"""Multi-host tests over network namespaces (skipped where the harness cannot run)."""
