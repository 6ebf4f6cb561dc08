"""gradring/tools."""
