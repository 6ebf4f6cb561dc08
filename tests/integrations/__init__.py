"""Lightning, Accelerate and transformers' Trainer on gradring, against their torch-DDP paths."""
