"""transformers' ``Trainer`` with ``gradring.install()``, under torchrun, against torch's DDP.

One torchrun launch of two CPU processes runs hf_trainer_run.py, which trains
the same tiny GPT-2 twice (torch's DDP, then gradring installed); the losses,
gradient norms and final parameters must be identical on both ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers is missing: pip install -e "
                    "'.[integrations]'")
pytest.importorskip("accelerate", reason="accelerate is missing: pip install -e '.[integrations]'")

import torch  # noqa: E402

from tests.integrations.common import exactly_equal, first_difference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 300


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):  # noqa: ANN001, ANN201
    """One torchrun launch for every configuration; the per-rank records."""
    out = tmp_path_factory.mktemp("hf-trainer")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "hf_trainer_run.py"), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=str(out), capture_output=True, text=True,
                          timeout=TIMEOUT - 20)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        assert res["segments_left"] == [] and not res["installed_after"]
    return ranks


def _check(ranks: list[dict], config: str, find_unused: bool) -> None:
    for rank, res in enumerate(ranks):
        runs = res[config]
        assert "error" not in runs["gradring"], f"rank {rank}: {runs['gradring']['error']}"
        assert runs["torch"]["wrapper"] == "torch.nn.parallel.distributed"
        assert runs["gradring"]["wrapper"] == "gradring.ddp"
        assert runs["torch"]["find_unused"] is runs["gradring"]["find_unused"] is find_unused
        assert len(runs["torch"]["losses"]) == 5
        for key in ("losses", "grad_norms", "params"):
            a, b = runs["torch"][key], runs["gradring"][key]
            assert exactly_equal(a, b), f"rank {rank}, {key}: {first_difference(a, b)}"
    assert exactly_equal(ranks[0][config]["gradring"]["params"],
                         ranks[1][config]["gradring"]["params"])
    # Training moved the weights.
    assert ranks[0][config]["torch"]["losses"][0] != ranks[0][config]["torch"]["losses"][-1]


@pytest.mark.timeout(TIMEOUT)
def test_trainer_matches_torch_ddp_without_find_unused(trainer_runs) -> None:
    _check(trainer_runs, "no_find_unused", find_unused=False)


@pytest.mark.timeout(TIMEOUT)
def test_trainer_matches_torch_ddp_with_its_default_arguments(trainer_runs) -> None:
    _check(trainer_runs, "default", find_unused=True)
