"""torch.compile(gradring DDP) over a range of bucket caps: the graph pieces
follow the buckets.

For each cap, measured while the compiled backward runs (not read from
gradring's own record of the split): which piece's backward delivered each
parameter's last gradient. From that, and the reducer's buckets:

- each bucket completes in one piece, and every piece that delivers
  gradients completes at least one bucket (a cut that completes none adds a
  graph and launches nothing sooner);
- the buckets complete in the reducer's order (they launch in index order,
  so a bucket completed before a lower one waits for it);
- no recompile after warm-up (the first compile and the one recompile at the
  bucket rebuild);
- the gradients of every step equal torch's eager DDP's on the same model and
  inputs, bit for bit (aot_eager runs the same kernels; inductor, which may
  fuse and reorder sums, is tested to a tolerance in tests/ranks/test_compile.py).

The model sums two embeddings (token and position), two independent branches
of the graph: at ``bucket_cap_mb=0.25`` the split once made a piece complete
the position table's bucket before the piece holding the token table's,
which comes first in the reducer's order (issue 55); on this model it did
so at 1, 0.25 and 0.05.
"""

import copy
import functools

import pytest
import torch
from torch import nn

import gradring
from gradring import compile as compile_split

#: smaller than any parameter: one bucket per parameter
_PER_PARAMETER = 1e-6


class _Tiny(nn.Module):
    """A GPT's outline: token + position embeddings, an MLP block on a
    residual stream, a final norm and a head (1.04 MB of float32)."""

    def __init__(self, vocab=512, seq=16, width=128):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(width), nn.Linear(width, 4 * width),
                           nn.Linear(4 * width, width)]) for _ in range(1))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for norm, fc, out in self.blocks:
            x = x + out(torch.relu(fc(norm(x))))
        return self.head(self.ln(x))


def _batches(rank, steps, vocab=512, seq=16):
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randint(0, vocab, (2, seq + 1), generator=g) for _ in range(steps)]


def _loss(logits, tokens):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


def _grads(module):
    return [p.grad.detach().clone() for p in module.parameters()]


def _counters():
    from torch._dynamo.utils import counters

    return (sum(counters["frames"].values()), sum(counters["graph_break"].values()),
            sum(counters["recompiles"].values()))


class _Deliveries:
    """Which compiled piece's backward delivered each parameter's gradient.

    A hook on every compiled piece's backward node notes the piece; a hook
    after each parameter's gradient accumulation notes the parameter. The
    engine runs a parameter's accumulation right after the node that made its
    gradient, so a parameter arrives from the piece noted last before it."""

    def __init__(self, module):
        self.events = []
        self._handles = [p.register_post_accumulate_grad_hook(
            functools.partial(self._param, i)) for i, p in enumerate(module.parameters())]

    def _param(self, i, _p):
        self.events.append(("param", i))

    def watch(self, loss):
        """Hook the compiled pieces' backward nodes of the graph behind ``loss``."""
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if "CompiledFunction" in type(node).__name__:
                self._handles.append(node.register_hook(
                    functools.partial(self._piece, len(seen))))
            todo.extend(n for n, _ in node.next_functions)

    def _piece(self, key, _grad_inputs, _grad_outputs):
        self.events.append(("piece", key))

    def last_piece_of(self):
        """parameter index -> position (in backward order) of the piece that
        delivered its last gradient; and how many pieces ran."""
        ran, where = -1, {}
        for kind, what in self.events:
            if kind == "piece":
                ran += 1
            else:
                where[what] = ran
        return where, ran + 1

    def remove(self):
        for h in self._handles:
            h.remove()


def _compiled_caps(rank, world_size, cap, steps=3):
    """Train gradring's DDP, compiled, and torch's eager DDP on the same
    batches; report per step how many gradients differ, the graphs compiled per
    step and, for the last step, where every parameter's gradient came from."""
    import torch._dynamo

    torch._dynamo.reset()
    return _train(cap, _batches(rank, steps))


def _train(cap, batches):
    steps = len(batches)
    base = _Tiny()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    want = []
    for tokens in batches:
        ref.zero_grad(set_to_none=True)
        _loss(ref(tokens[:, :-1]), tokens).backward()
        want.append(_grads(ref.module))
    graphs = []

    def counting(gm, example_inputs, **kw):
        from torch._dynamo.backends.registry import lookup_backend

        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs, **kw)

    ddp = gradring.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    model = torch.compile(ddp, backend=counting)
    diffs, seen, deliveries = [], [], None
    for step, tokens in enumerate(batches):
        ddp.zero_grad(set_to_none=True)
        loss = _loss(model(tokens[:, :-1]), tokens)
        if step == steps - 1:
            deliveries = _Deliveries(ddp.module)
            deliveries.watch(loss)
        loss.backward()
        got = _grads(ddp.module)
        diffs.append(sum(not torch.equal(a, b) for a, b in zip(got, want[step])))
        seen.append((len(graphs), _counters()))
    where, pieces = deliveries.last_piece_of()
    deliveries.remove()
    reducer = ddp.reducer
    return {"diffs": diffs, "seen": seen, "pieces": pieces, "where": where,
            "nparams": len(reducer.params), "nbuckets": len(reducer.buckets),
            "bucket_of": [reducer.bucket_of(i) for i in range(len(reducer.params))],
            "split": compile_split.splits(ddp)[-1].piece_buckets,
            "predicted": compile_split.splits(ddp)[-1].predicted}


def _check(r):
    # every parameter's gradient arrived from a compiled piece
    assert sorted(r["where"]) == list(range(r["nparams"])), r
    completes = {}  # bucket -> the piece (backward order) that delivered its last gradient
    for i, piece in r["where"].items():
        b = r["bucket_of"][i]
        completes[b] = max(completes.get(b, -1), piece)
    assert sorted(completes) == list(range(r["nbuckets"])), r
    # the buckets complete in the reducer's order
    order = [completes[b] for b in range(r["nbuckets"])]
    assert order == sorted(order), (order, r)
    # every piece that delivered gradients completed a bucket
    assert set(order) == set(r["where"].values()), (order, r)
    assert not r["predicted"] and len(r["split"]) == r["pieces"], r
    # no recompile after the first compile and the one at the rebuild (step 2)
    assert len(set(r["seen"][1:])) == 1, r["seen"]
    # bit for bit: per step, how many gradients differ at all
    assert r["diffs"] == [0] * len(r["diffs"]), r["diffs"]


def _run(pools, cap):
    results = pools.run(2, _compiled_caps, cap, timeout=300)
    for r in results:
        _check(r)
    return results


def test_pieces_follow_the_buckets_at_a_small_cap(pools):
    # 0.05 MB: several buckets, some of them one parameter; the split before
    # the fix completed the token table's bucket after the position table's.
    (r, _) = _run(pools, 0.05)
    assert r["nbuckets"] >= 3, r


@pytest.mark.slow
@pytest.mark.parametrize("cap", [25, 1, 0.25, _PER_PARAMETER])
def test_pieces_follow_the_buckets_at_cap(pools, cap):
    (r, _) = _run(pools, cap)
    if cap == _PER_PARAMETER:
        assert r["nbuckets"] == r["nparams"], r
    else:
        assert r["nbuckets"] >= (1 if cap == 25 else 2), r
