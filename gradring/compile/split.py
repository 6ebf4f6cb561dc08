"""Compiled graphs split at gradring's buckets.

[Note: compile and the buckets]
AOTAutograd turns the backward of a compiled graph into one function that the
autograd engine runs as a single node: every parameter gradient inside it
becomes ready when that function returns, so a bucket can only launch when
the whole compiled backward is done and nothing overlaps. The cure is to
split the forward graph where one bucket ends and the next begins; each
piece is compiled on its own, its backward is its own autograd node, and the
gradients of the pieces that run first in backward (the last layers) fire
their hooks while earlier pieces still compute.

Dynamo calls the splitter itself: while a compiled frame runs inside a DDP
forward (torch's class attribute ``_active_ddp_module`` is set, see
torch's ``DistributedDataParallel._inside_ddp_forward``), ``convert_frame`` builds a
``DDPOptimizer`` from ``torch._dynamo.backends.distributed`` and compiles the
frame through its ``compile_fn``. ``DDPOptimizer`` only knows one byte cap
and a fixed 1 MiB first bucket; gradring's buckets have their own rules (an
explicit ``bucket_cap_mb`` caps the first bucket too, ``bucket_cap_mb_list``,
dtype keys, the arrival-order rebuild). So ``install()`` puts a small factory
in that name: for a gradring DDP it builds :class:`BucketSplit`, whose
partition follows the reducer's buckets; for torch's own DDP it builds
torch's ``DDPOptimizer`` unchanged. The splitting, metadata propagation and
per-piece compilation after the partition are torch's own helpers.

Where a piece ends: walking the graph from its end (the order backward runs
in), right after a node that completes a bucket, i.e. brings the last of
its parameters, where the cut keeps the buckets in order ([Note: where a
piece may end]); a cut anywhere else adds a graph and launches nothing
sooner.

[Note: where a piece may end]
The reducer launches its buckets in index order, so a bucket whose piece
finishes before a lower bucket is complete waits for it, and the cut that
finished it early gains nothing. A cut is therefore made only where the
buckets completed so far (by this graph's nodes) are this graph's lowest
ones. The walk's order is not always the order of the rebuild: two branches
of the graph that meet (a token and a position embedding, summed) have no
order of their own, and the first backward, which the rebuild records, may
have run them either way. GPT-2's shape at ``bucket_cap_mb=0.25`` showed it:
bucket 7 held the token table and the first LayerNorm, bucket 8 the position
table; the walk meets the position table first, and a cut there completed
bucket 8 one piece before bucket 7. Such buckets now complete in one piece.
A bucket completes at the last node of the walk that reads one of its
parameters (a parameter read twice has its gradient after its first use in
forward). And a piece that feeds nothing into the piece after it in forward
joins that piece: the engine could run their backwards in either order, so
only pieces that hand each other their gradients keep the order counted on
here. Inside a piece the order does not matter: its parameters' gradients
all arrive when its backward returns. With caps smaller than one parameter
(one bucket each), a linear node completes two buckets, its bias and its
weight, in one piece.

Which buckets: after the rebuild (and always with find_unused_parameters),
the reducer's installed ones. Dynamo compiles at the first forward, before
the rebuild, when there is nothing to follow yet; then every node that uses
parameters gets a piece of its own, so the first backward delivers gradients
in true backward order for the rebuild to record. Right after the rebuild,
``after_rebuild`` drops the code compiled that way (``torch._dynamo.reset_code``)
and the next call compiles once more at the rebuilt buckets: the one
recompile. ``splits(ddp)`` lists every split made.

Each split made after the rebuild remembers the bucket of every parameter
it followed; should the installed buckets change again, ``after_rebuild``
drops the code of every split that no longer matches them, and it compiles
once more.

[Note: the arrival order under compile]
A piece can only end between nodes, and one node's backward hands out all of
its parameters' gradients at once (a linear node: weight and bias). A bucket
boundary that the rebuild puts between two parameters of one node can thus
not be a cut: both buckets complete in the same piece. The rebuild puts a
boundary right after the parameter that fills the bucket, so it falls
between nodes when each node's largest parameter arrives last, as eager
autograd delivers a linear layer (bias, then weight). The compiled backward
of a piece returns its gradients in the order of the piece's inputs, and
autograd runs the parameters' accumulation nodes in that order (they all
have the top priority; with at most two of them torch's ready queue pops
them first-in first-out). So the provisional pieces, whose backward is the
one the rebuild records, take their inputs in this order: the other inputs
first, then the parameters, smallest first (``_smallest_parameters_first``).
The rebuilt buckets then end at node boundaries and are those of eager mode,
one piece per bucket (6 x ``Linear(1024)``, ``bucket_cap_mb=5``: three
buckets of 8396800 bytes and three pieces; weight first, they were 4 buckets
for 3 pieces, the 4096-byte bias of the first layer a bucket of its own that
completed in the piece of the one before). The pieces made after the rebuild
keep torch's input order: nothing records their order.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import distributed as _torch_distributed

from gradring.compile.never_traced import NEVER_TRACED
from gradring.reducer import Reducer

if TYPE_CHECKING:
    from torch import fx

#: torch's class, captured at import time (``gradring.install()`` may later
#: rebind the public names): Dynamo's DDP support sets ``_active_ddp_module`` on it.
_TORCH_DDP = _torch_distributed.DistributedDataParallel

# Per DDP module, the splits made for it, oldest first (see splits()); an
# entry goes with its module.
_SPLITS: weakref.WeakKeyDictionary[Any, list[Split]] = weakref.WeakKeyDictionary()

log = logging.getLogger(__name__)

#: "buckets": split a gradring DDP's graphs at its own buckets (BucketSplit);
#: "torch": let torch's DDPOptimizer split them by ``bucket_bytes_cap`` and its
#: fixed 1 MiB first bucket, as it does for torch's DDP (kept for comparison,
#: ``benchmarks/compile.py --split torch``).
SPLIT_BY = "buckets"

_install_lock = threading.Lock()
_installed = False


@dataclass
class Split:
    """One split made for a gradring DDP: the pieces, first in forward order."""

    #: per piece, the bucket indices whose parameters it uses
    piece_buckets: list[list[int]] = field(default_factory=list)
    #: per piece, its number of call nodes (ops)
    piece_ops: list[int] = field(default_factory=list)
    #: whether the pieces are provisional (made before the bucket rebuild)
    predicted: bool = False
    #: weak reference to the code object Dynamo compiled (to drop it at the rebuild)
    code: Any = None
    #: set once the rebuild dropped this split's compiled code
    retired: bool = False
    #: the bucket of each parameter index that the pieces follow
    layout: tuple[int, ...] = ()


def install() -> None:
    """Let Dynamo's DDP support split graphs at gradring's buckets (idempotent).

    Does nothing until Dynamo is imported (then nothing can be compiled yet);
    the DDP forward calls it every time, so it takes effect before the first
    compiled call."""
    global _installed
    if _installed or "torch._dynamo" not in sys.modules:
        return
    with _install_lock:
        if _installed:
            return
        try:
            from torch._dynamo import trace_rules
            from torch._dynamo.backends import distributed as dynamo_ddp
        except ImportError:  # a torch without Dynamo: nothing to split
            _installed = True
            return
        for name in NEVER_TRACED:
            trace_rules.add(name)
        original = getattr(dynamo_ddp, "DDPOptimizer", None)
        if original is None or getattr(original, "_gradring_factory", False):
            _installed = True
            return

        def factory(bucket_bytes_cap: int, backend_compile_fn: Callable[..., Any],
                    first_bucket_cap: int | None = None) -> Any:
            active = _TORCH_DDP._active_ddp_module
            # A gradring DDP is the one whose reducer is gradring's.
            if isinstance(getattr(active, "reducer", None), Reducer) and SPLIT_BY == "buckets":
                return BucketSplit(active, backend_compile_fn)
            return original(bucket_bytes_cap=bucket_bytes_cap,
                            backend_compile_fn=backend_compile_fn,
                            first_bucket_cap=first_bucket_cap)

        factory._gradring_factory = True  # type: ignore[attr-defined]
        factory.original = original  # type: ignore[attr-defined]
        dynamo_ddp.DDPOptimizer = factory
        _installed = True


def _params_of(node: fx.Node, gm: fx.GraphModule) -> list[torch.Tensor]:
    """The parameters (real tensors) a graph node reads."""
    found: list[torch.Tensor] = []
    if node.op == "placeholder":
        arg = node.meta.get("grapharg")
        example = getattr(arg, "example", None)
        if isinstance(example, torch.nn.Parameter):
            found.append(example)
    elif node.op == "get_attr":
        value = getattr(gm, str(node.target), None)
        if isinstance(value, torch.nn.Parameter):
            found.append(value)
    elif node.op == "call_module":
        found.extend(gm.get_submodule(str(node.target)).parameters())
    return found


def _node_params(gm: fx.GraphModule) -> dict[fx.Node, list[torch.Tensor]]:
    """Per non-placeholder node, the parameters it consumes directly."""
    placeholder_params = {n: _params_of(n, gm) for n in gm.graph.nodes if n.op == "placeholder"}
    out: dict[fx.Node, list[torch.Tensor]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        params = [] if node.op == "call_function" else _params_of(node, gm)
        for arg in node.all_input_nodes:
            params.extend(placeholder_params.get(arg, ()))
        out[node] = params
    return out


class BucketSplit:
    """Dynamo's DDP ``compile_fn`` for a gradring DDP: one compiled piece per run of buckets."""

    def __init__(self, ddp: Any, backend_compile_fn: Callable[..., Any]) -> None:
        self.ddp = ddp
        self.backend_compile_fn = backend_compile_fn

    def bucket_of(self, order: list[int]) -> tuple[dict[int, int], bool]:
        """param index -> bucket index, and whether the buckets are provisional.

        ``order`` holds the parameter indices in reverse order of use in the
        graph, by node: ``order[k]`` lists those the k-th node from the end
        brings first. Before the rebuild every such node gets a bucket of its
        own (see [Note: compile and the buckets]).
        """
        reducer = self.ddp.reducer
        if reducer.order_is_final:
            return {i: reducer.bucket_of(i) for i in range(len(reducer.params))}, False
        return {i: k for k, group in enumerate(order) for i in group}, True

    def partition(self, gm: fx.GraphModule) -> tuple[dict[fx.Node, int], Split]:
        """Assign every node a piece; pieces are numbered in forward order."""
        reducer = self.ddp.reducer
        node_params = _node_params(gm)
        # The nodes in the order backward runs them, each with the indices of
        # the reducer's parameters it reads.
        walk = [(node, list(dict.fromkeys(
                    i for i in map(reducer.index_of, node_params[node]) if i is not None)))
                for node in reversed(gm.graph.nodes) if node.op not in ("placeholder", "output")]
        order: list[list[int]] = []
        brings_new: list[bool] = []  # per step: whether a parameter is read first there
        seen: set[int] = set()
        for _, mine in walk:
            new = [i for i in mine if i not in seen]
            seen.update(new)
            brings_new.append(bool(new))
            if new:
                order.append(new)
        bucket_of, predicted = self.bucket_of(order)
        # Walk backward through the graph. A piece ends before the next node
        # with new parameters once it completed a bucket and has an output
        # another piece reads; after the rebuild, only where the buckets
        # completed so far are this graph's first ones in the reducer's order
        # (see [Note: where a piece may end]). Before the rebuild every node
        # with new parameters starts a piece of its own.
        if predicted:
            completes, in_order = brings_new, [True] * len(walk)
        else:
            completes, in_order = _completions([mine for _, mine in walk], bucket_of)
        pieces: list[list[fx.Node]] = [[]]
        buckets: list[set[int]] = [set()]
        members: set[fx.Node] = set()
        done, may_end = False, False
        for step, (node, mine) in enumerate(walk):
            if brings_new[step] and done and may_end and _has_external_user(pieces[-1], members):
                pieces.append([])
                buckets.append(set())
                members = set()
                done = False
            pieces[-1].append(node)
            members.add(node)
            buckets[-1].update(bucket_of[i] for i in mine)
            done = done or completes[step]
            may_end = in_order[step]
        if len(pieces) > 1 and not buckets[-1]:
            # A preamble before the first parameter: it joins the piece after it.
            pieces[-2].extend(pieces.pop())
            buckets.pop()
        if not predicted:
            pieces, buckets = _chained(pieces, buckets)
        pieces.reverse()
        buckets.reverse()
        where = {node: k for k, nodes in enumerate(pieces) for node in nodes}
        split = Split([sorted(b) for b in buckets],
                      [sum(n.op.startswith("call") for n in nodes) for nodes in pieces],
                      predicted, layout=_layout(reducer) if not predicted else ())
        return where, split

    def compile_fn(self, gm: fx.GraphModule, example_inputs: list[Any],
                   **compiler_configs: Any) -> Any:
        where, split = self.partition(gm)
        split.code = _compiling_code()
        _SPLITS.setdefault(self.ddp, []).append(split)
        log.info("gradring: split a compiled graph into %d pieces at buckets %s%s",
                 len(split.piece_buckets), split.piece_buckets,
                 " (predicted rebuild)" if split.predicted else "")
        if len(split.piece_buckets) == 1 and not (split.predicted and split.piece_buckets[0]):
            return self.backend_compile_fn(gm, example_inputs, **compiler_configs)
        from torch._dynamo.backends import distributed as dynamo_ddp
        from torch._dynamo.utils import detect_fake_mode
        from torch.fx.passes.split_module import split_module

        split_gm = split_module(gm, None, lambda n: where[n])  # type: ignore[arg-type]
        dynamo_ddp.propagate_dynamo_source(gm, split_gm)
        dynamo_ddp.propagate_metadata(gm, split_gm)
        if split.predicted:  # the backward the rebuild records
            _smallest_parameters_first(split_gm)
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None:
            fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
        compiler = dynamo_ddp.SubmodCompiler(split_gm, self.backend_compile_fn, fake_mode,
                                             **compiler_configs)
        with torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing():
            compiler.run(*example_inputs)
        split_gm.recompile()
        return split_gm


def _param_bytes(node: fx.Node) -> int:
    """The size in bytes of the parameter a placeholder stands for; -1 for any other input."""
    example = getattr(node.meta.get("grapharg"), "example", None)
    if not isinstance(example, torch.nn.Parameter):
        return -1
    return example.numel() * example.element_size()


def _smallest_parameters_first(split_gm: fx.GraphModule) -> None:
    """Reorder every piece's inputs: other inputs first, then its parameters,
    smallest first (see [Note: the arrival order under compile])."""
    for call in split_gm.graph.nodes:
        if call.op != "call_module" or call.kwargs:
            continue
        piece = split_gm.get_submodule(str(call.target))
        inputs = [n for n in piece.graph.nodes if n.op == "placeholder"]
        if len(inputs) != len(call.args):
            continue
        sizes = [_param_bytes(a) if isinstance(a, torch.fx.Node) else -1 for a in call.args]
        order = sorted(range(len(inputs)), key=sizes.__getitem__)  # stable
        if order == list(range(len(inputs))):
            continue
        anchor = next(n for n in piece.graph.nodes if n.op != "placeholder")
        for j in order:
            anchor.prepend(inputs[j])
        call.args = tuple(call.args[j] for j in order)
        piece.recompile()


def _completions(walk: list[list[int]], bucket_of: dict[int, int]
                 ) -> tuple[list[bool], list[bool]]:
    """Per step of a backward walk (the parameter indices each node reads):
    whether a bucket completes there, and whether the buckets completed so far
    are then the graph's first ones in the reducer's order.

    A parameter read by several nodes has its gradient only after the last of
    them in the walk (its first use in forward), so a bucket completes at
    the last step that reads one of its parameters."""
    last: dict[int, int] = {}
    for step, mine in enumerate(walk):
        for i in mine:
            last[bucket_of[i]] = step
    first_ones = sorted(last)
    completes = [False] * len(walk)
    for step in last.values():
        completes[step] = True
    in_order, done, highest = [], 0, -1
    for step in range(len(walk)):
        finished = [b for b, at in last.items() if at == step]
        done += len(finished)
        highest = max([highest, *finished])
        in_order.append(done == 0 or first_ones[done - 1] == highest)
    return completes, in_order


def _chained(pieces: list[list[fx.Node]], buckets: list[set[int]]
             ) -> tuple[list[list[fx.Node]], list[set[int]]]:
    """The pieces (in backward order) with each one that feeds nothing into
    the piece before it joined to that piece (see [Note: where a piece may end])."""
    out_pieces, out_buckets = [pieces[0]], [buckets[0]]
    for nodes, used in zip(pieces[1:], buckets[1:]):
        later = set(out_pieces[-1])
        if any(user in later for node in nodes for user in node.users):
            out_pieces.append(nodes)
            out_buckets.append(used)
        else:
            out_pieces[-1] = out_pieces[-1] + nodes
            out_buckets[-1] = out_buckets[-1] | used
    return out_pieces, out_buckets


def _has_external_user(nodes: list[fx.Node], members: set[fx.Node]) -> bool:
    """Whether some node of a piece is read outside it (so the piece has an output)."""
    return any(user not in members for node in nodes for user in node.users)


def _compiling_code() -> Any:
    """A weak reference to the code object of the frame Dynamo is compiling, if known."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return weakref.ref(InstructionTranslator.current_tx().f_code)
    except Exception:  # noqa: BLE001 - only a missed recompile at the rebuild
        return None


def _layout(reducer: Reducer) -> tuple[int, ...]:
    """The installed bucket of every parameter index."""
    return tuple(reducer.bucket_of(i) for i in range(len(reducer.params)))


def after_rebuild(ddp: Any) -> int:
    """The installed buckets just changed: drop the code compiled with pieces
    that follow other buckets, so the next call compiles once more, split at
    the new ones: the provisional pieces at the rebuild, and any pieces made
    for buckets that are no longer the installed ones. Returns how many code
    objects were dropped."""
    dropped = 0
    now: tuple[int, ...] | None = None
    for split in _SPLITS.get(ddp, ()):
        if split.retired:
            continue
        if not split.predicted:
            now = _layout(ddp.reducer) if now is None else now
            if split.layout == now:
                continue
        split.retired = True
        code = split.code() if split.code is not None else None
        if code is not None:
            torch._dynamo.reset_code(code)
            dropped += 1
    if dropped:
        log.info("gradring: buckets rebuilt; %d compiled frame(s) will recompile once", dropped)
    return dropped


def splits(ddp: Any) -> list[Split]:
    """The graph splits Dynamo made for ``ddp`` so far, oldest first."""
    return list(_SPLITS.get(ddp, ()))
