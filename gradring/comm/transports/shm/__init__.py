"""gradring/comm/transports/shm."""
