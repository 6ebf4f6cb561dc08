"""gradring/comm/algos."""
