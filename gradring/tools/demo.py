"""``gradring demo``: train a real classifier on N local processes and check it.

    gradring demo                                   # 2 processes, 3 epochs
    gradring demo --small                           # CI: 1 epoch of 10 batches
    gradring demo --out run1 --nproc 3              # files into ./run1

scikit-learn's handwritten digits (1,797 8x8 images, shipped inside the
package, no download) train an MLP under gradring's DDP; its 2.2 MiB of
gradients travel in several buckets, so the first buckets' all-reduces run
while the backward still computes. At the end the demo retrains the same
model in one process on the same global batches and checks that the
parameters agree, prints how much communication the backward left exposed,
draws a timeline of the last iterations from the ranks' merged trace, and
ends with ``gradring explain``'s summary of the step (docs/overlap.md and
docs/explain.md say how to read them). Every file goes into ``--out``
(default: a new folder named for the run), and the demo prints each path.

The demo may run as root in a folder other users can write to, so it writes
nothing through what they could have prepared (see [Note: output files in
folders other users can reach] in ``safe_files.py``): the default folder is
created new (mode 0700; a random suffix is added if the name is taken), an
``--out`` folder that exists must be ours and writable by us alone, and every
file is opened without following a link and refused if somebody else's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from torch import nn

EPOCH_SEED = 1234


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train/test split of the digits data (synthetic stand-in if scikit-learn is absent)."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.int64)
    except ImportError:  # keep the demo runnable; say so
        print("scikit-learn not installed: using synthetic digits-shaped data", flush=True)
        g = torch.Generator().manual_seed(0)
        centers = torch.rand(10, 64, generator=g)
        y = torch.randint(0, 10, (1797,), generator=g)
        x = centers[y] + 0.15 * torch.randn(1797, 64, generator=g)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    mean, std = x[:1500].mean(0), x[:1500].std(0) + 1e-3
    x = (x - mean) / std
    return x[:1500], y[:1500], x[1500:], y[1500:]


#: Said before the demo's explain summary: its bucket-cap finding is about a setting the
#: demo chose, not one the user did.
DEMO_CAP_NOTE = ("(the demo sets bucket_cap_mb=0.1 on purpose, to show several buckets: "
                 "a finding about the bucket cap below is about the demo's choice, not yours)")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # Two 1 MiB layers: after the rebuild (first bucket 1 MiB, then bucket_cap_mb=0.1)
    # the gradients travel in three buckets, the output layers' first.
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def global_batches(n: int, batch: int, epoch: int,
                   max_batches: int | None = None) -> list[torch.Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(EPOCH_SEED + epoch))
    usable = n - n % batch
    return list(perm[:usable].split(batch))[:max_batches]


def _bar(done: int, total: int, width: int = 30) -> str:
    k = int(width * done / max(total, 1))
    return "[" + "#" * k + "." * (width - k) + f"] {done}/{total}"


def train_rank(rank: int, world: int, epochs: int, per_rank: int, lr: float,
               max_batches: int | None = None, trace_dir: str | None = None) -> dict[str, Any]:
    import gradring
    from gradring.observe.overlap import ddp_overlap_stats, export_chrome_trace
    from gradring.tools import explain_record as explain

    xtr, ytr, xte, yte = load_digits_tensors()
    model = gradring.DistributedDataParallel(make_model(), bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    accs = []
    for epoch in range(epochs):
        batches = global_batches(len(ytr), per_rank * world, epoch, max_batches)
        for i, idx in enumerate(batches):
            mine = idx[rank * per_rank:(rank + 1) * per_rank]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xtr[mine]), ytr[mine]).backward()
            opt.step()
            if rank == 0 and (i % 5 == 0 or i == len(batches) - 1):
                print(f"\repoch {epoch + 1}/{epochs} {_bar(i + 1, len(batches))}", end="",
                      flush=True)
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        accs.append(acc)
        if rank == 0:
            print(f"  test accuracy {acc:.3f}", flush=True)
    stats = model.overlap_stats() if hasattr(model, "overlap_stats") \
        else ddp_overlap_stats(model)
    # Collective, every rank: time a few all-reduces on this link, then explain the run.
    curve = explain.measure_link(model)
    summary = explain.analyse(model.comm.all_gather_object(explain.rank_record(model, curve)))
    trace = None
    if trace_dir is not None:
        trace = export_chrome_trace(model, os.path.join(trace_dir, f"rank{rank}.json"),
                                    curve=curve)
    return {
        "explain": summary.text,
        "params": [p.detach().clone() for p in model.module.parameters()],
        "accs": accs,
        # explain's mean step (one forward's start to the next one's), over the steps
        # overlap_stats() summarises: the demo's share of exposed communication is explain's
        "step_ms": summary.parts[rank]["step"],
        "overlap": stats,
        "trace": trace,
    }


def train_single(world: int, epochs: int, per_rank: int, lr: float,
                 max_batches: int | None = None) -> list[torch.Tensor]:
    xtr, ytr, _, _ = load_digits_tensors()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        for idx in global_batches(len(ytr), per_rank * world, epoch, max_batches):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
    return [p.detach() for p in model.parameters()]


def _overlap_summary(result: dict[str, Any]) -> list[str]:
    from gradring.observe.overlap import format_table

    ov, step = result["overlap"], result["step_ms"]
    if not ov or not ov.get("iterations"):
        return []
    return [
        f"overlap: exposed communication {ov['exposed_ms']:.2f} ms/step of {step:.2f} ms "
        f"({ov['exposed_ms'] / step:.1%})",
        f"  rank 0, means over {ov['iterations']} steps (every one after the first; the "
        "steps and figures of gradring explain): backward "
        f"{ov['backward_ms']:.2f} ms, all-reduce running {ov['comm_ms']:.2f} ms, "
        f"{ov['overlap_ratio']:.0%} of it during the backward; backward() ran "
        f"{ov['tail_ms']:.2f} ms past autograd (waiting + copying into .grad)",
        *("  " + line for line in format_table(ov).splitlines()),
    ]


def _draw(results: list[dict[str, Any]], image: str | None, merged_out: str) -> list[str]:
    """Merge the ranks' traces into ``merged_out`` and draw ``image`` from them."""
    from gradring.observe.overlap import merge_traces

    merged = merge_traces([r["trace"] for r in results], merged_out)
    lines = [f"merged trace (open in ui.perfetto.dev; `gradring explain` reads it): {merged}"]
    if not image:
        return lines
    try:
        from gradring.tools.timeline import draw_timeline

        draw_timeline(merged, image, last=3, title="gradring demo: last 3 steps")
    except ImportError:  # matplotlib is in the [demo] extra; keep the demo runnable
        return [*lines, "timeline skipped: matplotlib is not installed"]
    return [*lines, f"timeline of the last 3 steps: {image}"]


def parser() -> argparse.ArgumentParser:
    """``gradring demo``'s command line."""
    from gradring.tools.helpfmt import command_parser

    ap = command_parser(
        "gradring demo",
        "See gradring work in a minute: train a small classifier of handwritten digits on "
        "several local processes with gradring's DistributedDataParallel, check that "
        "every process ends with the same model as one process training on the same "
        "batches, and show how much communication the backward hid: a table per bucket, "
        "a timeline picture of the last steps and `gradring explain`'s summary. Every "
        "file goes into one folder, and the demo prints each path.",
        [("gradring demo", "2 processes, 3 epochs; files in a new folder"),
         ("gradring demo --small", "a quick run: 1 epoch of 10 batches"),
         ("gradring demo --out run1 --nproc 3", "3 processes, files into ./run1")],
        "Read the output with docs/overlap.md and docs/explain.md.")
    ap.add_argument("--nproc", type=int, default=2, metavar="N", help="local processes")
    ap.add_argument("--epochs", type=int, default=3, metavar="N", help="passes over the data")
    ap.add_argument("--batch", type=int, default=32, metavar="N",
                    help="batch size on each process")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    ap.add_argument("--small", action="store_true",
                    help="a quick run: 1 epoch of 10 batches (for CI)")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="folder for every file the demo writes (default: a new folder "
                         "gradring-demo-YYYYMMDD-HHMMSS; one that exists must be yours and "
                         "writable by you alone)")
    ap.add_argument("--timeline", default=None, metavar="PNG",
                    help="where to draw the timeline (default: OUT/timeline.png; '' to skip)")
    ap.add_argument("--trace", default=None, metavar="JSON",
                    help="where to keep the merged trace (default: OUT/trace.json)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    from gradring.safe_files import (
        UnsafePath,
        check_output,
        make_fresh_dir,
        make_output_dir,
        open_output,
    )
    from gradring.tools.launch import run_local

    try:
        out = make_output_dir(a.out) if a.out else \
            make_fresh_dir(time.strftime("gradring-demo-%Y%m%d-%H%M%S"))
        image = os.path.join(out, "timeline.png") if a.timeline is None else a.timeline
        merged = a.trace or os.path.join(out, "trace.json")
        for path in (image, merged, os.path.join(out, "explain.txt")):
            if path:
                check_output(path)
    except OSError as exc:  # UnsafePath included: it names the path and the reason
        print(f"gradring demo: {exc}", file=sys.stderr)
        return 2
    epochs, max_batches = (1, 10) if a.small else (a.epochs, None)
    torch.set_num_threads(1)
    print(f"gradring demo: {a.nproc} processes, digits MLP, per-rank batch {a.batch}; "
          f"files in {out}", flush=True)
    t0 = time.perf_counter()
    results = run_local(train_rank, a.nproc, epochs, a.batch, a.lr, max_batches, out)
    wall = time.perf_counter() - t0
    ref = train_single(a.nproc, epochs, a.batch, a.lr, max_batches)
    worst = max((p - q).abs().max().item() for p, q in zip(results[0]["params"], ref))
    same_everywhere = all(
        all(torch.equal(p, q) for p, q in zip(results[0]["params"], r["params"]))
        for r in results)
    print(f"trained in {wall:.1f}s; final test accuracy {results[0]['accs'][-1]:.3f}")
    print(f"replicas identical on all ranks: {same_everywhere}")
    ok = worst < 1e-4
    print(f"matches one process on the global batches: {ok} (max |diff| {worst:.2e})")
    for line in _overlap_summary(results[0]):
        print(line)
    print("per-rank traces: " + ", ".join(r["trace"] for r in results))
    summary = os.path.join(out, "explain.txt")
    try:
        for line in _draw(results, image, merged):
            print(line)
        with open_output(summary, "w") as f:
            f.write(DEMO_CAP_NOTE + "\n" + results[0]["explain"] + "\n")
    except UnsafePath as exc:
        print(f"gradring demo: {exc}", file=sys.stderr)
        return 2
    print(f"explain summary: {summary}")
    print(DEMO_CAP_NOTE)
    print(results[0]["explain"])
    return 0 if ok and same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
