"""gradring/comm/transports."""
