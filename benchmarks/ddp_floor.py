"""The floor of a DDP step: gradring's DDP against the least a DDP can do over
gradring's own transport.

    python benchmarks/ddp_floor.py                        # world 2, all models
    python benchmarks/ddp_floor.py --models resnet gpt --steps 7 --rounds 7

Runs ``gradring bench ddp`` (``gradring.tools.bench.ddp_step.measure``) with one
more set-up, ``floor``: ``FlatDDP`` below, stepped in the same shuffled turns,
and prints the bench's tables and then the floor's: per model, the floor's and
gradring's overhead over the pair (medians of per-round figures), each as a
fraction of torch's, and gradring's minus the floor's, which is what the
reducer's own machinery costs.

``FlatDDP`` keeps torch's DDP semantics for the bench's models (rank 0's
buffers before every forward, gradients averaged when ``backward()``
returns) with as little machinery as that takes:

- one shared-memory byte buffer for every buffer, one broadcast per forward,
  one ``_foreach_copy_`` to pack and one to unpack;
- one shared-memory buffer for every gradient, one all-reduce at the end of
  the backward, one ``_foreach_copy_`` in, one multiply, one out;
- a post-accumulate hook per parameter that only counts, and the end-of-
  backward callback queued when the count is complete.

No buckets, no overlap, no checks: it assumes every parameter gets a
gradient in every backward, one dtype of gradients, and no ``no_sync``. What
it costs above the pair is the synchronisation and the data work that any
DDP on this transport pays, so gradring's overhead minus the floor's is
what the reducer's features cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch
from torch import nn

from gradring import comm
from gradring.tools.bench import ddp_step
from gradring.tools.bench.load import load_note

_ALIGN = 16


class FlatDDP(nn.Module):
    """A minimal DDP for benchmarks (see the module docstring); not for training."""

    def __init__(self, module: nn.Module, group: Any = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world = torch.distributed.get_world_size(group)
        self.rank = torch.distributed.get_rank(group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1:
            raise ValueError(f"FlatDDP takes one gradient dtype, got {sorted(map(str, dtypes))}")
        self._grads = comm.empty((sum(p.numel() for p in self._params),),
                                 dtype=dtypes.pop(), group=group)
        self._grad_views = [v.view_as(p) for v, p in zip(
            torch.split(self._grads, [p.numel() for p in self._params]), self._params)]
        self._synced = [b for b in module.buffers()]
        offsets, total = [], 0
        for b in self._synced:
            offsets.append(total)
            total += -(-b.numel() * b.element_size() // _ALIGN) * _ALIGN
        self._bytes = comm.empty((max(total, 1),), dtype=torch.uint8, group=group)
        self._buffer_views = [
            self._bytes[o:o + b.numel() * b.element_size()].view(b.dtype).view_as(b)
            for o, b in zip(offsets, self._synced)]
        self._seen = 0
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._count)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._synced and self.world > 1:
            with torch.no_grad():
                if self.rank == 0:
                    torch._foreach_copy_(self._buffer_views, self._synced)
                comm.broadcast(self._bytes, group_src=0, group=self.group)
                if self.rank != 0:
                    torch._foreach_copy_(self._synced, self._buffer_views)
        self._seen = 0
        return self.module(*args, **kwargs)

    def _count(self, _param: torch.Tensor) -> None:
        self._seen += 1
        if self._seen == len(self._params):
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self) -> None:
        grads = [p.grad for p in self._params]
        with torch.no_grad():
            torch._foreach_copy_(self._grad_views, grads)
            if self.world > 1:
                comm.all_reduce(self._grads, group=self.group)
            self._grads.mul_(1.0 / self.world)
            torch._foreach_copy_(grads, self._grad_views)


def floor_table(results: dict[str, dict[str, list[float]]]) -> list[str]:
    """The floor's overhead beside torch's and gradring's, medians over rounds of
    per-round figures; no lines when no model stepped the floor."""
    rows = [name for name, res in results.items() if "floor" in res]
    if not rows:
        return []
    lines = ["", "floor = a minimal flat DDP over gradring's transport (one broadcast, one "
             "all-reduce at the end, no buckets); per-round overheads, medians",
             f"{'model':<12}{'ovh floor':>11}{'ovh gradring':>14}{'floor/torch':>13}"
             f"{'gradring/torch':>16}{'gradring-floor':>16}"]
    for name in rows:
        res = results[name]
        per = {k: [v - p for v, p in zip(res[k], res["pair"])] for k in ("torch", "gradring",
                                                                         "floor")}
        med = {k: statistics.median(v) for k, v in per.items()}
        extra = statistics.median([g - f for g, f in zip(per["gradring"], per["floor"])])
        frac = {k: (f"{med[k] / med['torch']:.2f}" if med["torch"] > 0 else "noisy")
                for k in ("floor", "gradring")}
        lines.append(f"{name:<12}{med['floor']:>11.2f}{med['gradring']:>14.2f}"
                     f"{frac['floor']:>13}{frac['gradring']:>16}{extra:>16.2f}")
    return lines


def run(nproc: int = 2, models: list[str] | None = None, steps: int = 5, rounds: int = 5,
        load: int = 0) -> str:
    """The bench with the floor beside it: the bench's tables, then the floor's."""
    results = ddp_step.measure(nproc, models, steps, rounds, load=load,
                               extra_setups={"floor": FlatDDP})
    return "\n".join([load_note(load) + ddp_step.report(results, nproc),
                      *floor_table(results)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/ddp_floor.py", description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ddp_step.add_run_arguments(ap)
    a = ap.parse_args(argv)
    ddp_step.check_run_arguments(ap, a)
    print(run(a.nproc, a.models, a.steps, a.rounds, a.load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
