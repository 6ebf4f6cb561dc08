from __future__ import annotations

import pytest

from tests.support.rankpool import RankPool

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

    def run(self, world_size: int, fn, *args, timeout: float = 120, **kwargs):
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size)
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
