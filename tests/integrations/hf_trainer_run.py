"""A tiny transformers ``Trainer`` run, on torch's DDP and then with gradring installed.

Launched by tests/integrations/test_transformers.py as

    torchrun --standalone --nproc-per-node 2 tests/integrations/hf_trainer_run.py OUT_DIR

For each of CONFIGS, each rank trains a 2-layer GPT-2 built from a config
(vocabulary 100, width 32, nothing downloaded) twice with the same seed and
data, and writes what it saw to OUT_DIR/rank<r>.pt for the test to compare.
An error of gradring's run is recorded instead of ending the launch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)


class _Tokens(torch.utils.data.Dataset):
    """48 random token sequences of length 16; the labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 100, (48, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _train(impl: str, config_name: str, out_dir: str) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradring.install import install

    _reset_accelerate()
    switch = install() if impl == "gradring" else contextlib.nullcontext()
    with switch:
        config = GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        args = TrainingArguments(
            output_dir=os.path.join(out_dir, config_name, impl), per_device_train_batch_size=4,
            gradient_accumulation_steps=2, max_steps=5, learning_rate=1e-2, max_grad_norm=1.0,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo", ddp_timeout=120,
            # "default": the Trainer decides, which for a PreTrainedModel without
            # activation checkpointing is find_unused_parameters=True.
            ddp_find_unused_parameters=None if config_name == "default" else False)
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        rec = {
            "wrapper": type(trainer.model_wrapped).__module__,
            "find_unused": trainer.model_wrapped.find_unused_parameters,
            "losses": [h["loss"] for h in logs],
            "grad_norms": [float(h["grad_norm"]) for h in logs],
            "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        }
    _reset_accelerate()
    return rec


#: The Trainer's own choice of DDP arguments, and find_unused_parameters=False.
CONFIGS = ("default", "no_find_unused")


def main() -> None:
    out_dir = sys.argv[1]
    import gradring

    results: dict[str, Any] = {}
    try:
        for config_name in CONFIGS:
            results[config_name] = runs = {}
            for impl in ("torch", "gradring"):
                try:
                    runs[impl] = _train(impl, config_name, out_dir)
                except RuntimeError as exc:  # raised alike on every rank, before any collective
                    if impl == "torch":
                        raise
                    runs[impl] = {"error": f"{type(exc).__name__}: {exc}"}
                    _reset_accelerate()
        results["installed_after"] = (
            torch.nn.parallel.DistributedDataParallel is gradring.DistributedDataParallel)
        dist.barrier()  # nobody closes its connections while a peer still reads
    finally:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        gradring.comm.shutdown()
        mine = f"gradring-{os.getpid()}-"
        results["segments_left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith(mine))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
