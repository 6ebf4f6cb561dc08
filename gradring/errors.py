"""Every user-facing error text of the DDP side, in one place.

Where users search for torch's wording, the first sentence matches it on
purpose; gradring then adds what torch leaves out: parameter names and ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def _names(indices: Sequence[int], names: Sequence[str], limit: int = 20) -> str:
    shown = [f"{i} ({names[i] if 0 <= i < len(names) else '?'})"
             for i in list(indices)[:limit]]
    more = len(indices) - len(shown)
    return ", ".join(shown) + (f", ... and {more} more" if more > 0 else "")


#: The advice that ends every model-mismatch error: DDP averages gradients
#: position by position, so every rank must hold the same parameters.
SAME_MODEL = ("To fix: build the model the same way on every rank (same modules, in the same "
              "order, with the same shapes), and load any checkpoint on every rank or none.")


def param_count_mismatch(counts: Sequence[int]) -> str:
    bad = next(r for r, c in enumerate(counts) if c != counts[0])
    return (
        f"DDP expects same model across all ranks, but Rank 0 has {counts[0]} params, "
        f"while rank {bad} has inconsistent {counts[bad]} params. {SAME_MODEL}"
    )


def param_shape_mismatch(
    index: int, name: str, what: str, theirs: Sequence[int], ref: Sequence[int], rank: int,
    *, this_rank: int, mine: Sequence[int],
) -> str:
    """Parameter ``index`` has ``theirs`` on ``rank`` but ``ref`` on rank 0; this
    process (``this_rank``) has ``mine``. Each rank's message states its own
    value, then the two ranks that differ, naming each rank once."""
    if this_rank == rank:
        head = (f"params[{index}] in this process with {what} {list(theirs)} appears not to "
                f"match {what} of the same param in process 0.")
    else:
        head = (f"params[{index}] in process {rank} with {what} {list(theirs)} appears not to "
                f"match {what} of the same param in process 0.")
    # The two sides of the mismatch are ``rank`` and rank 0; this process is one
    # of them or a third rank, and each rank is named once.
    sides = [f"this process (rank {this_rank}) has {what} {list(mine)}"]
    sides += [f"rank {r} has {list(v)}" for r, v in ((rank, theirs), (0, ref))
              if r != this_rank]
    return (f"{head} (gradring: params[{index}] is '{name}'; {', '.join(sides)}.) "
            f"{SAME_MODEL}")


def param_order_mismatch(index: int, ours: str, theirs: str, rank: int, *,
                         this_rank: int) -> str:
    """Same shapes, different parameters at one position: training would mix them up."""
    return (f"DDP expects the same model on every rank, but params[{index}] is '{ours}' on rank "
            f"0 and '{theirs}' on rank {rank} (this process is rank {this_rank}). The shapes "
            "agree, so the gradients would be averaged across different parameters without "
            "any error: construct the model's modules in the same order on every rank.")


def unfinished_reduction(
    per_rank_missing: dict[int, list[int]], names: Sequence[str], *, static_graph: bool,
    world_size: int = 0, debug: bool = False, rank: int = 0, find_unused: bool = False,
) -> str:
    """The error of a forward whose prior backward left a reduction unfinished.

    ``debug``: TORCH_DISTRIBUTED_DEBUG is INFO or DETAIL. torch's sentences are kept
    word for word (people search for them): without debug, its advice to set the
    variable; with it, its line naming this ``rank``'s parameters. gradring names
    every rank's parameters either way."""
    head = (
        "Expected to have finished reduction in the prior iteration before starting a new "
        "one. "
    )
    if static_graph:
        head += (
            "This error indicates that your training graph has changed in this iteration, "
            "e.g., one parameter is used in first iteration, but then got unused in the "
            "second iteration. this is not compatible with static_graph set to True. "
        )
    elif find_unused:
        # torch's sentence would advise find_unused_parameters=True, already set.
        head += (
            "This error indicates that your module has parameters that were not used in "
            "producing loss, and that unused parameter detection (find_unused_parameters, "
            "which is on) did not find them: make sure all `forward` function outputs "
            "participate in calculating loss, and that every tensor that leads to a "
            "parameter is in the return value of `forward`. "
        )
    else:
        head += (
            "This error indicates that your module has parameters that were not used in "
            "producing loss. You can enable unused parameter detection by passing the "
            "keyword argument `find_unused_parameters=True` to "
            "`gradring.DistributedDataParallel`, and by making sure all `forward` function "
            "outputs participate in calculating loss. "
        )
    lines = [head.rstrip()]
    for r in sorted(per_rank_missing):
        idx = per_rank_missing[r]
        lines.append(
            f"Parameter indices which did not receive grad for rank {r}: "
            f"{' '.join(map(str, idx))}\n"
            f"  names: {_names(idx, names)}"
        )
    if debug:
        mine = per_rank_missing.get(rank, [])
        lines.append(f"Parameters which did not receive grad for rank {rank}: "
                     + ", ".join(names[i] for i in mine))
    else:
        lines.append(
            "In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to "
            "either INFO or DETAIL to print out information about which particular "
            "parameters did not receive gradient on this rank as part of this error "
            "(gradring names them above in any case)."
        )
    silent = [r for r in range(world_size) if r not in per_rank_missing]
    if silent:
        lines.append(
            f"Ranks {silent} did not report an unfinished reduction: they most likely "
            "produced gradients for every parameter and are waiting in a collective for this "
            "rank, i.e. the ranks disagree on which parameters were used."
        )
    distinct = {tuple(v) for v in per_rank_missing.values()}
    if len(distinct) > 1:
        lines.append("The ranks above disagree on which parameters were used.")
    lines.append(_unused_advice(static_graph, find_unused))
    return "\n".join(lines)


def _unused_advice(static_graph: bool, find_unused: bool = False) -> str:
    """The last line of the unfinished-reduction error: what to change, among
    the settings the user does not have yet."""
    if static_graph:
        switch = ("static_graph=False" if find_unused else
                  "static_graph=False and find_unused_parameters=True")
        return ("To fix: use the same parameters in every iteration, or construct DDP with "
                f"{switch}.")
    if find_unused:
        return ("To fix: return from `forward` every output the loss is computed from, and "
                "run the backward from all of them (or from none of a branch); if the ranks "
                "disagree, build the model and its forward's branches the same way on every "
                "rank.")
    return ("To fix: pass find_unused_parameters=True to the DDP constructor, or make every "
            "parameter take part in the loss; if the ranks disagree, build the model and its "
            "forward's branches the same way on every rank.")


def marked_twice(index: int, name: str, *, static_graph: bool = False,
                 find_unused: bool = False) -> str:
    """A parameter's gradient arrived twice in one backward; the likely causes
    (and their fixes) are those of the settings in force."""
    causes = ["the parameter is used outside the module's `forward` (its gradient was "
              "produced twice)"]
    checkpoint = ("reentrant backward passes reuse it, e.g. `torch.utils.checkpoint` with "
                  "use_reentrant=True around a module that runs more than once (use "
                  "use_reentrant=False")
    if not static_graph:
        checkpoint += ", or static_graph=True if the graph does not change between iterations"
    causes.append(checkpoint + ")")
    if find_unused and not static_graph:
        causes.append("the same module is wrapped by several DDP instances or called several "
                      "times in one forward while find_unused_parameters is on")
    else:
        causes.append("the same module is wrapped by several DDP instances")
    listed = "; ".join(f"{k}) {c}" for k, c in enumerate(causes, 1))
    return (
        "Expected to mark a variable ready only once. "
        f"Parameter {index} ('{name}') had its gradient reduced twice in this backward. "
        f"Likely causes: {listed}."
    )


def static_graph_newly_used(index: int, name: str, *, first_count: int = 0,
                            find_unused: bool = False) -> str:
    """static_graph: a parameter's gradient arrived more often in this backward
    than in the first iteration (``first_count`` times; 0: it was unused there)."""
    if first_count == 0:
        what = "received a gradient but was unused in the first iteration"
    else:
        what = (f"received more gradients in this iteration than the {first_count} of the "
                "first iteration (e.g. a second backward over part of the graph)")
    switch = "static_graph=False" if find_unused else \
        "static_graph=False (with find_unused_parameters=True if some iterations leave " \
        "parameters unused)"
    return (
        "Your training graph has changed in this iteration, e.g., one parameter is unused "
        "in first iteration, but then got used in the second iteration. this is not "
        f"compatible with static_graph set to True. (gradring: parameter {index} "
        f"'{name}' {what}.) To fix: run the same graph in every iteration, or construct DDP "
        f"with {switch}."
    )


def backward_twice() -> str:
    return (
        "gradring DDP: backward() ran a second time after a single forward() while "
        "gradient synchronization is on. As with torch's DDP, the gradients of this "
        "backward are only accumulated locally, NOT averaged across ranks, so replicas "
        "will drift apart. To average two losses from one forward, use "
        "torch.autograd.backward([l1, l2]) or (l1 + l2).backward(); to accumulate "
        "locally on purpose, run the extra forward and backward inside no_sync(). "
        "(Reported once per DDP instance.)"
    )


def meta_parameters(module_name: str) -> str:
    return (f"DistributedDataParallel got a {module_name} whose parameters are on the meta "
            "device (shapes only, no values to average). Materialise it first: "
            "module.to_empty(device=...), initialise its parameters (e.g. reset_parameters() "
            "or load a state_dict), then wrap it in DistributedDataParallel.")


def delay_all_reduce_half_given() -> str:
    return ("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
            "same time.")


def no_trainable_params() -> str:
    return (
        "DistributedDataParallel is not needed when a module doesn't have any parameter "
        "that requires a gradient."
    )


def mixed_devices(devices: Sequence[str]) -> str:
    return (
        "gradring DDP needs every parameter on one device, but the module's parameters "
        f"are on {sorted(set(devices))}. Move the module to a single device first."
    )


def not_initialized(environ: Mapping[str, str] | None = None) -> str:
    """DDP built before ``init_process_group``. The advice depends on whether a
    launcher (torchrun or another that sets ``RANK``) started this process:
    under one, only the call is missing."""
    env = os.environ if environ is None else environ
    head = "Default process group has not been initialized, please make sure to call "
    tail = " before constructing gradring.DistributedDataParallel."
    if env.get("TORCHELASTIC_RUN_ID") or env.get("RANK"):
        launcher = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "the launcher"
        return (head + "init_process_group" + tail + f" This process was started by {launcher} "
                f"(RANK={env.get('RANK', '?')}, WORLD_SIZE={env.get('WORLD_SIZE', '?')}), so "
                "the call alone is missing: add torch.distributed.init_process_group(\"gloo\") "
                "(\"nccl\" on GPUs) at the start of the script; it reads these variables.")
    return (head + "init_process_group (or launch under torchrun)" + tail + " RANK is not set, "
            "so no launcher started this process: start the script with `torchrun "
            "--nproc-per-node=N script.py`, which sets RANK, WORLD_SIZE and MASTER_ADDR for "
            "init_process_group, or pass rank=, world_size= and a store to it yourself.")


def bucket_context(index: int, nbytes: int, param_indices: Sequence[int],
                   names: Sequence[str], iteration: int) -> str:
    return (
        f"gradring DDP: this was the all-reduce of bucket {index} ({nbytes} bytes) in "
        f"iteration {iteration}, holding parameters {_names(param_indices, names, limit=12)}."
    )


def static_graph_too_late() -> str:
    return ("set_static_graph() should be called before training loop starts and after "
            "DistributedDataParallel is constructed.")


def nothing_unused() -> str:
    return ("find_unused_parameters=True was specified in DDP constructor, but did not find "
            "any unused parameters in the forward pass. This flag results in an extra "
            "traversal of the autograd graph every iteration, which can adversely affect "
            "performance. If your model indeed never has any unused parameters in the forward "
            "pass, consider turning this flag off. Note that this warning may be a false "
            "positive if your model has flow control causing later iterations to have unused "
            "parameters.")


def static_graph_with_find_unused() -> str:
    return ("You passed find_unused_parameters=true to DistributedDataParallel, "
            "`_set_static_graph` will detect unused parameters automatically, so you do not "
            "need to set find_unused_parameters=true, just be sure these unused parameters "
            "will not change during training loop while calling `_set_static_graph`.")


def static_graph_twice() -> str:
    return "You've set static_graph to be True, no need to set it again."


def unsupported_argument(name: str) -> str:
    return (f"gradring.DistributedDataParallel does not support `{name}` yet; leave it at "
            "its default or use torch.nn.parallel.DistributedDataParallel.")


def check_reduction_deprecated() -> str:
    return ("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
            "Please avoid using it.")


def too_many_device_ids() -> str:
    return "device_ids can only be None or contain a single element."


def device_ids_on_cpu(device_ids: object, output_device: object, devices: object) -> str:
    return ("DistributedDataParallel device_ids and output_device arguments only work with "
            "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
            f"{device_ids}, output_device {output_device}, and module parameters {devices}.")


def auto_cap_without_rebuild(default_mb: float) -> str:
    return ("bucket_cap_mb='auto' picks the cap at the bucket rebuild, which "
            "find_unused_parameters skips (unless static_graph is set); "
            f"using {default_mb} MiB")


def bad_bucket_cap(value: object) -> str:
    return f"bucket_cap_mb must be a finite number or 'auto', got {value!r}"


def no_sync_with_fused_optim() -> str:
    return ("no_sync() cannot be used with a fused optimizer (_register_fused_optim): it "
            "steps during every backward.")


def hook_not_callable(hook: object) -> str:
    return f"Communication hook must be callable (got {type(hook).__name__})."


def comm_hook_twice() -> str:
    return "register_comm_hook or register_builtin_comm_hook can only be called once."


def torch_power_sgd_on_gloo(name: str) -> str:
    return (f"torch's {name} issues its second all-reduce from inside a gloo callback "
            "and waits for it there: with more than one bucket, ranks can pair those "
            "all-reduces in different orders (torch's DDP then aborts; this DDP can wait "
            f"until the process group times out). gradring.hooks.{name} orders them and "
            "takes the same PowerSGDState arguments.")


def comm_hook_with_fused_optim() -> str:
    return ("A communication hook cannot be combined with a fused optimizer "
            "(_register_fused_optim).")


def fused_optim_twice() -> str:
    return "_register_fused_optim can only be called once per DDP instance."


def fused_optim_with_comm_hook() -> str:
    return ("_register_fused_optim cannot be combined with a communication hook "
            "(register_comm_hook).")


def broadcast_buffers_deprecated(*, both: bool) -> str:
    if both:
        return ("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated and its value is ignored when "
                "`forward_sync_buffers` is provided.")
    return ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
            "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still "
            "syncs buffers at init. If you rely on buffers NOT being synced at init (e.g. "
            "rank-local buffers), keep using `broadcast_buffers=False` until "
            "`init_sync_buffers` is available.")


def torch_internal(name: str) -> str:
    return (f"gradring.DistributedDataParallel does not implement torch's internal `{name}`: "
            "it belongs to torch's C++ reducer machinery, which gradring replaces. If a "
            "library needs it, please report which one.")


def reducer_not_finalized() -> str:
    return ("Expected to have finished reduction in the prior iteration before starting a new "
            "one: the last backward did not reduce every bucket.")


def in_backward_optim_with_hook() -> str:
    return ("Parameters with optimizers applied in backward (_apply_optimizer_in_backward) "
            "cannot be combined with a communication hook or _register_fused_optim.")


class NotInitializedError(ValueError, RuntimeError):
    """DDP constructed before ``init_process_group``.

    torch's DDP raises ``ValueError`` here (from ``_get_default_group``); code
    written against earlier gradring caught ``RuntimeError``. Both catch this.
    """


def buffer_hook_not_callable(hook: object) -> str:
    return f"A buffer comm hook must be callable; {type(hook).__name__} is not."


def torch_sync_batchnorm_on_cpu(name: str) -> str:
    where = f" (torch.nn.SyncBatchNorm at {name!r})" if name else ""
    return ("SyncBatchNorm layers only work with GPU modules" + where + ": torch's "
            "SyncBatchNorm cannot run on CPU. Convert the model with "
            "gradring.nn.SyncBatchNorm.convert_sync_batchnorm(model) instead of "
            "torch.nn.SyncBatchNorm.convert_sync_batchnorm; gradring's SyncBatchNorm works "
            "on CPU.")


def param_not_in_reducer(name: str) -> str:
    return (
        f"Param with name {name} found in module parameters, but not DDP parameters. "
        "(gradring: the list given does not hold this parameter DDP reduces.)"
    )


def param_mapping_incomplete(given: int, named: int) -> str:
    return (
        "Expected param to name mapping to cover all parameters, but got conflicting "
        f"lengths: {given} vs {named}. (gradring: the list given holds parameters DDP "
        "does not reduce.)"
    )
