"""docs/torch-reads.md is what scripts/torch_reads.py makes of the installed sources.

The list says which attributes torch's DDP helpers (and Lightning's and
Accelerate's DDP code) read and write on the DDP object, its reducer and the
``GradBucket``. When torch (or Lightning, or Accelerate) touches a new name, the
generated list changes and ``test_doc_is_generated_from_the_installed_sources``
fails until the doc is regenerated; every ``ok`` name is then checked on gradring's
objects by tests/ranks/test_torch_reads_present.py. The other tests here pin the
walker's rules ([Note: how the walker tells a DDP, a reducer and a bucket apart]
in scripts/torch_reads.py) on small sources.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_reads", ROOT / "scripts" /
                                                  "torch_reads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("torch_reads", module)
    spec.loader.exec_module(module)
    return module


tr = _load()


def _reads(source: str, rel: str = "pkg/mod.py") -> set[tuple[str, str, str]]:
    return {(a.obj, a.name, a.how) for a in tr.scan_file(rel, textwrap.dedent(source))}


def test_doc_is_generated_from_the_installed_sources() -> None:
    for package in ("lightning", "accelerate"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install -e '.[integrations]')")
    current = tr.DOC.read_text(encoding="utf-8")
    generated = tr.generate(current)
    if generated != current:
        new = set(generated.splitlines()) - set(current.splitlines())
        gone = set(current.splitlines()) - set(generated.splitlines())
        pytest.fail("docs/torch-reads.md is not what the installed torch, Lightning and "
                    "Accelerate give: run `.venv/bin/python scripts/torch_reads.py --write`, "
                    "then look at each new name (tests/ranks/test_torch_reads_present.py "
                    "checks it on gradring).\nnew lines:\n" + "\n".join(sorted(new))
                    + "\nlines gone:\n" + "\n".join(sorted(gone)))


def test_every_status_is_ok_na_or_pending_with_a_reason() -> None:
    statuses = tr.parse_statuses(tr.DOC.read_text(encoding="utf-8"))
    assert statuses, "no rows parsed from docs/torch-reads.md"
    for (obj, name), status in statuses.items():
        kind, _, reason = status.partition(":")
        assert kind in ("ok", "n/a", "pending"), (obj, name, status)
        if kind != "ok":
            assert reason.strip(), f"{obj}.{name}: '{kind}' needs a reason"


def test_zero_overlap_hooks_read_of_has_rebuilt_buckets_is_listed() -> None:
    """The read that started the list: ZeRO's overlap hooks and ``_has_rebuilt_buckets``."""
    statuses = tr.parse_statuses(tr.DOC.read_text(encoding="utf-8"))
    assert statuses[("DDP", "_has_rebuilt_buckets")].startswith("ok")
    assert ("GradBucket", "index") in statuses and ("reducer", "_rebuild_buckets") in statuses


def test_names_annotations_and_weakrefs_are_a_ddp() -> None:
    src = """
    def f(ddp, model: DistributedDataParallel, ddp_ref, hook_state, other):
        ddp.a
        model.b()
        ddp_ref().c
        ddp_weakref = hook_state.ddp_weakref
        ddp_weakref().d
        other.not_listed
    """
    assert _reads(src) == {("DDP", "a", "read"), ("DDP", "b", "call"), ("DDP", "c", "read"),
                           ("DDP", "d", "read")}


def test_reducer_through_cast_and_tuple_assignment() -> None:
    src = """
    def f(ddp_inst, model: DDP):
        reducer, pg = ddp_inst.reducer, ddp_inst.process_group
        reducer._run_allreduce_hook(1)
        r = cast(Reducer, model.reducer)
        r._rebuild_buckets()
        r = something_else()
        r.gone()
    """
    assert _reads(src) == {("DDP", "reducer", "read"), ("DDP", "process_group", "read"),
                           ("reducer", "_run_allreduce_hook", "call"),
                           ("reducer", "_rebuild_buckets", "call")}


def test_isinstance_proves_a_ddp_where_it_holds() -> None:
    src = """
    import torch
    class S:
        def a(self):
            if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                self.model.inside = 1
            self.model.outside
        def b(self, model):
            if not isinstance(model, DistributedDataParallel):
                return
            model.after_return()
        def c(self, model):
            options = (DistributedDataParallel, torch.nn.DataParallel)
            while isinstance(model, options):
                model = model.module
            model.after_loop
        def d(self, m):
            assert isinstance(m, DDP)
            getattr(m, "static_graph", False)
            setattr(m, "flag", True)
    """
    assert _reads(src) == {("DDP", "inside", "write"), ("DDP", "after_return", "call"),
                           ("DDP", "module", "read"), ("DDP", "static_graph", "read"),
                           ("DDP", "flag", "write")}


def test_buckets_and_joinables() -> None:
    src = """
    def hook(state, bucket: dist.GradBucket):
        bucket.buffer()
    def helper(bucket, state):
        bucket.is_last()
    def other(b):
        b.not_a_bucket()
    def join(joinable: Joinable):
        joinable.join_device
    """
    assert _reads(src) == {("GradBucket", "buffer", "call"), ("GradBucket", "is_last", "call")}
    assert _reads(src, "torch/distributed/algorithms/join.py") == {
        ("GradBucket", "buffer", "call"), ("GradBucket", "is_last", "call"),
        ("DDP", "join_device", "read")}


def test_a_new_read_in_torch_changes_the_list() -> None:
    """What the doc test sees when torch's ZeRO hook reads one more name."""
    site = Path(__import__("torch").__file__).resolve().parents[1]
    rel = "torch/distributed/algorithms/ddp_comm_hooks/ddp_zero_hook.py"
    source = (site / rel).read_text(encoding="utf-8")
    before = tr.scan_file(rel, source)
    marker = "    if not ddp_ref()._has_rebuilt_buckets:"
    assert marker in source
    after = tr.scan_file(rel, source.replace(
        marker, "    ddp_ref()._a_new_flag\n" + marker))
    added = {(a.obj, a.name) for a in after} - {(a.obj, a.name) for a in before}
    assert added == {("DDP", "_a_new_flag")}
    assert tr.render(after, {}, {}) != tr.render(before, {}, {})


def test_stale_hints_are_an_error() -> None:
    with pytest.raises(RuntimeError, match="HINTS"):
        tr.scan_file("accelerate/utils/dataclasses.py", "def unrelated():\n    pass\n")
