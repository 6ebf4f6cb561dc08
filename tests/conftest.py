from __future__ import annotations

import os

import pytest

from tests.support.env import run_with_environ
from tests.support.rankpool import RankPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# [Note: both policies]
# The suite runs gradring's default, buckets launched as they become ready
# (see [Note: overlap needs a free core] in gradring/reducer/overlap_policy.py).
# The files that compare gradring's DDP against torch's run twice, once per
# policy: [ready], the default, and [at_end] with GRADRING_OVERLAP=0, every
# bucket reduced on the training thread when the backward ends. Their rank
# bodies get the variable through the pools (Pools.environ).
BOTH_POLICIES = {
    "tests/ranks/test_ddp_buckets.py", "tests/ranks/test_ddp_buffers.py",
    "tests/ranks/test_ddp_constructor.py", "tests/ranks/test_ddp_create_graph.py",
    "tests/ranks/test_ddp_diagnostics.py", "tests/ranks/test_ddp_forward_backward_patterns.py",
    "tests/ranks/test_ddp_inputs_and_outputs.py", "tests/ranks/test_ddp_nesting_and_rewrapping.py",
    "tests/ranks/test_ddp_no_sync.py", "tests/ranks/test_ddp_post_accumulate_hooks.py",
    "tests/ranks/test_ddp_semi_private.py", "tests/ranks/test_ddp_state_dict_and_pickling.py",
    "tests/ranks/test_ddp_unused_parameters.py", "tests/ranks/test_ddp_identity.py",
    "tests/ranks/test_ddp_oracle.py",
    "tests/ranks/test_grad_layout.py", "tests/ranks/test_small_params.py",
    "tests/ranks/test_no_sync_unused.py", "tests/ranks/test_join.py",
    "tests/ranks/test_hooks.py", "tests/ranks/test_sparse_grads.py",
    "tests/ranks/test_skip_unused_buckets.py", "tests/ranks/test_irregular.py",
    "tests/ranks/test_reducer_fast_path.py", "tests/ranks/test_mixed_precision.py",
}
POLICIES = {"ready": {}, "at_end": {"GRADRING_OVERLAP": "0"}}


def pytest_generate_tests(metafunc) -> None:  # noqa: ANN001
    path = os.path.relpath(str(metafunc.definition.path), ROOT)
    if path in BOTH_POLICIES and "pools" in metafunc.fixturenames:
        metafunc.fixturenames.append("policy")
        metafunc.parametrize("policy", list(POLICIES), indirect=True)


@pytest.fixture
def policy(request, pools):  # noqa: ANN001
    """Set the pools' environment for the test (see [Note: both policies])."""
    pools.environ = POLICIES[request.param]
    yield request.param
    pools.environ = {}


# [Note: the default suite and the slow one]
# `pytest -q` (the README's command) runs what needs at most the shared rank
# pools; `pytest -q -m slow` runs what starts fresh jobs end to end (faults that
# kill or stop ranks, torchrun and elastic restarts, the soak, network
# namespaces, the frameworks, the demo, every docs code block). .ci/run runs
# both. A file or test is slow by its own marker, or by being listed here with
# the reason, so that the split is visible in one place.
SLOW_FILES = {
    "tests/jobs/test_reliability.py": "fault jobs: ranks killed, stalled or desynced, one job each",
    "tests/jobs/test_shm_hardening.py": "fault jobs on the shared-memory transport",
    "tests/jobs/test_elastic.py": "torchrun with elastic restarts",
    "tests/jobs/test_soak.py": "thousands of steps",
    "tests/jobs/test_concurrent_jobs.py": "several small jobs at once, some crashing",
    "tests/jobs/test_orphans.py": "torchrun jobs whose ranks or agent are killed or stopped",
    "tests/multihost/test_netns.py": "torchrun across network namespaces",
    "tests/multihost/test_netns_faults.py": "torchrun across namespaces: small /dev/shm, faults",
    "tests/integrations/test_lightning.py": "Lightning trainers and Fabric",
    "tests/integrations/test_accelerate.py": "Accelerate",
    "tests/integrations/test_transformers.py": "transformers' Trainer",
    "tests/integrations/test_timm_sync_batchnorm.py": "timm models",
}
SLOW_TESTS = {
    "tests/jobs/test_examples.py::test_elastic_crash_recipe_crashes_again_when_rerun":
        "torchrun, twice",
    "tests/jobs/test_examples.py::test_bench_runs_from_the_package_alone":
        "a pip install and a bench",
    "tests/jobs/test_timeline_tune.py::test_demo_small_end_to_end": "the demo",
    "tests/jobs/test_timeline_tune.py::test_demo_writes_into_out_by_default": "the demo",
    "tests/jobs/test_timeline_tune.py::test_tune_cli_finds_a_workload_in_the_current_folder":
        "the tuner's CLI, end to end",
    "tests/ranks/test_pool.py::test_pool_reports_rank_failures": "kills and restarts a rank pool",
    "tests/jobs/test_comm_multiprocess.py::test_dead_or_silent_peer_raises_and_leaves_no_segments":
        "a fault job",
    "tests/jobs/test_comm_multiprocess.py::test_two_jobs_on_one_host_do_not_collide": "two jobs",
}


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001
    for item in items:
        path, _, rest = item.nodeid.partition("::")
        name = path + "::" + rest.split("[")[0]
        if path in SLOW_FILES or name in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


class Pools:
    """Lazily started rank pools, one per world size, shared by the whole session."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}
        # Environment variables set around every rank body (see [Note: both policies]).
        self.environ: dict[str, str] = {}

    def run(self, world_size: int, fn, *args, timeout: float = 120, **kwargs):
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size)
        if self.environ:
            return pool.run(run_with_environ, self.environ, fn, *args, timeout=timeout,
                            **kwargs)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
