"""gradring/observe."""
