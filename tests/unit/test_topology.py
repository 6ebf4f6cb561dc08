"""Topology grouping, the multi-host choice, and the hierarchical all-reduce on threads.

The hierarchical composition runs on thread-ranks: one ThreadedWorld per
simulated host plays its shared memory, and one over all ranks plays the
process group's point-to-point, so H hosts x L ranks run in one process
and are checked against the naive oracle (exact, on integer-valued data)
and against the flat ring (within float tolerance, on random data).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

from gradring import config
from gradring.comm import ops, select
from gradring.comm.algos import hierarchical, ring
from gradring.comm.collective import Collective
from gradring.comm.ops import Op
from gradring.comm.transport import CollectiveError, Kind
from gradring.comm.transports import topology
from gradring.comm.transports.hosts import HostTransports, SubsetTransport
from gradring.comm.transports.topology import Topology
from tests.support import comm_oracle
from tests.support.threaded import ThreadedWorld, run_ranks

pytestmark = pytest.mark.timeout(120)

OPS = tuple(Op(n) for n in ("SUM", "AVG", "MAX", "MIN"))


# ----------------------------------------------------------------- grouping (pure)
def ident(host: str, **kw) -> dict:
    return {"host": host, "boot": "b", "netns": 1, "pidns": 2, "shm": 3, **kw}


def test_group_by_host_contiguous_and_interleaved():
    assert topology.group_by_host([ident("a"), ident("a"), ident("b"), ident("b")]) == \
        [[0, 1], [2, 3]]
    assert topology.group_by_host([ident("b"), ident("a"), ident("b"), ident("a")]) == \
        [[0, 2], [1, 3]]
    assert topology.group_by_host([ident("a")] * 3) == [[0, 1, 2]]
    assert topology.group_by_host([ident(str(i)) for i in range(4)]) == [[0], [1], [2], [3]]


def test_each_identity_field_separates_hosts():
    """Same hostname but another netns, /dev/shm, boot or pid namespace: another host."""
    base = ident("a")
    for field, other in (("netns", 9), ("shm", 9), ("boot", "x"), ("pidns", 9), ("host", "z")):
        ids = [base, dict(base, **{field: other})]
        assert topology.group_by_host(ids) == [[0], [1]], field


def test_topology_properties():
    t = topology.from_identities([ident("a"), ident("b"), ident("a"), ident("b")], rank=3)
    assert t.hosts == ((0, 2), (1, 3)) and t.names == ("a", "b")
    assert (t.num_hosts, t.host_index, t.local_rank, t.local_size) == (2, 1, 1, 2)
    assert t.local_ranks == (1, 3) and t.peers == (2, 3) and t.uniform
    assert "a: ranks [0, 2]" in t.describe()
    ragged = Topology(((0, 1, 2), (3,)), rank=0)
    assert not ragged.uniform
    with pytest.raises(ValueError, match=r"different numbers of ranks: \[3, 1\]"):
        _ = ragged.peers
    with pytest.raises(ValueError, match="do not partition"):
        Topology(((0, 1), (3,)), rank=0)


def test_host_identity_is_this_process():
    me = topology.host_identity()
    assert me["netns"] == os.stat("/proc/self/ns/net").st_ino
    assert me["shm"] == os.stat("/dev/shm").st_dev
    assert set(me) == {"host", "boot", "netns", "pidns", "shm"}


def test_exchange_through_a_store():
    """Four threads publish fake identities through one HashStore, twice (fresh keys)."""
    store = dist.HashStore()
    hosts = ["a", "b", "a", "b"]
    for _ in range(2):
        out: list = [None] * 4

        def body(r: int, out: list = out) -> None:
            out[r] = topology.exchange(store, r, 4, 10.0, identity=ident(hosts[r]))

        threads = [threading.Thread(target=body, args=(r,)) for r in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        assert all(o is not None for o in out)
        assert {o[0].hosts for o in out} == {((0, 2), (1, 3))}
        assert len({o[1] for o in out}) == 1  # one shared prefix per round
    assert out[0][1] == "gradring/topo/1/"


# ----------------------------------------------------------------- selection
def test_choose_on_several_hosts():
    c = select.choose(Kind.ALL_REDUCE, 4, 4, select.HOSTS, None)
    assert c == select.Choice(select.HOSTS, "hierarchical")
    assert select.choose(Kind.ALL_REDUCE, 1 << 24, 4, select.HOSTS, "hierarchical").algo == \
        "hierarchical"
    assert select.choose(Kind.ALL_REDUCE, 1 << 24, 4, select.HOSTS, "ring") == \
        select.Choice("torch", "ring")
    assert select.choose(Kind.ALL_REDUCE, 4, 4, select.HOSTS, "tree") == \
        select.Choice("torch", "tree")
    assert select.choose(Kind.BROADCAST, 4, 4, select.HOSTS, None) == \
        select.Choice("torch", "tree")
    assert select.choose(Kind.ALL_GATHER, 4, 4, select.HOSTS, None) == \
        select.Choice("torch", "ring")
    # Elsewhere "hierarchical" means the default choice.
    assert select.choose(Kind.ALL_REDUCE, 1 << 24, 2, "shm", "hierarchical").algo == \
        "direct/twoshot"
    assert select.choose(Kind.ALL_GATHER, 4, 2, "shm", "hierarchical").algo == "direct"
    assert select.choose(Kind.ALL_REDUCE, 1 << 24, 2, "torch", "hierarchical").algo == "ring"


def test_env_accepts_hierarchical(monkeypatch):
    monkeypatch.setenv("GRADRING_ALGO", "hierarchical")
    assert config.current().algo == "hierarchical"


# ----------------------------------------------------------------- hierarchical on threads
def rank_data(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers: every summation order gives the same exact result."""
    i = torch.arange(count, dtype=torch.int64)
    return ((i * 7 + rank * 13) % 11 - 5).to(dtype)


def info(seq: int, t: torch.Tensor) -> Collective:
    return Collective("threads", seq, Kind.ALL_REDUCE, t.numel() * t.element_size(), t.dtype,
                      algo="hierarchical")


class Hosts:
    """H simulated hosts: one ThreadedWorld each (shared memory) + one over all ranks."""

    def __init__(self, hosts: tuple[tuple[int, ...], ...], timeout: float = 30.0,
                 p2p_hosts: tuple[int, ...] = ()) -> None:
        self.hosts = hosts
        # Hosts that run without shared memory (as after /dev/shm ran out there).
        self.p2p_hosts = p2p_hosts
        self.world_size = sum(len(h) for h in hosts)
        self.flat = ThreadedWorld(self.world_size, timeout=timeout)
        self.local = [ThreadedWorld(len(h), timeout=timeout) for h in hosts]

    def transports(self, flat_t) -> HostTransports:
        topo = Topology(self.hosts, flat_t.rank, tuple(f"h{i}" for i in range(len(self.hosts))))
        if topo.host_index in self.p2p_hosts:
            return HostTransports(topo, None, flat_t)
        local = self.local[topo.host_index].transport(topo.local_rank)
        return HostTransports(topo, local, flat_t)

    def run(self, fn, *args, timeout: float = 60.0):
        return run_ranks(self.world_size, lambda t, *a: fn(self.transports(t), *a), *args,
                         world=self.flat, timeout=timeout)


LAYOUTS = (((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 1, 2), (3, 4, 5)), ((0, 1), (2, 3), (4, 5)),
           ((0, 1, 2),), ((0,), (1,)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda h: "x".join(str(len(x)) for x in h)
                         + ("i" if h == ((0, 2), (1, 3)) else ""))
def test_hierarchical_matches_oracle(layout):
    sim = Hosts(layout)
    w = sim.world_size
    cases = [(n, dt, op) for n in (0, 1, 5, 1000, 10007)
             for dt in (torch.float32, torch.int32, torch.bfloat16) for op in OPS]

    def body(h: HostTransports):
        outs = []
        for seq, (n, dt, op) in enumerate(cases, 1):
            x = rank_data(h.rank, n, dt)
            i = info(seq, x)
            h.start(i)
            hierarchical.all_reduce(h, i, x, op)
            outs.append(x)
        return outs

    results = sim.run(body)
    for k, (n, dt, op) in enumerate(cases):
        want = comm_oracle.oracle_all_reduce([rank_data(r, n, dt) for r in range(w)], op)
        for r in range(w):
            assert torch.equal(results[r][k], want), (layout, n, dt, op, r)


@pytest.mark.parametrize("layout,p2p", [(((0, 1), (2, 3)), (1,)), (((0, 2), (1, 3)), (0,)),
                                        (((0, 1, 2), (3, 4, 5)), (0, 1)),
                                        (((0, 1), (2, 3), (4, 5)), (1,))])
def test_hierarchical_with_a_host_off_shared_memory_matches_oracle(layout, p2p):
    """A host that dropped its shared memory (its /dev/shm ran out) runs the intra-host
    phases over point-to-point; the other hosts, still on shared memory, run unchanged
    and every rank gets the exact result (see [Note: a host without room in /dev/shm])."""
    sim = Hosts(layout, p2p_hosts=p2p)
    w = sim.world_size
    cases = [(n, dt, op) for n in (0, 1, 5, 1000, 10007)
             for dt in (torch.float32, torch.int32) for op in OPS]

    def body(h: HostTransports):
        outs = []
        for seq, (n, dt, op) in enumerate(cases, 1):
            x = rank_data(h.rank, n, dt)
            i = info(seq, x)
            h.start(i)
            hierarchical.all_reduce(h, i, x, op)
            h.finish()
            outs.append(x)
        return outs

    results = sim.run(body)
    for k, (n, dt, op) in enumerate(cases):
        want = comm_oracle.oracle_all_reduce([rank_data(r, n, dt) for r in range(w)], op)
        for r in range(w):
            assert torch.equal(results[r][k], want), (layout, p2p, n, dt, op, r)


def test_hierarchical_zero_copy_and_bits_identical():
    """Buffers in (simulated) host memory are used in place; all ranks end bit-identical."""
    sim = Hosts(((0, 1), (2, 3)))
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(50_003, generator=gen) for _ in range(4)]

    def body(h: HostTransports):
        out = []
        for seq, zero_copy in enumerate((False, True, False), 1):
            x = h.local.world.empty(data[h.rank].numel()) if zero_copy else \
                torch.empty_like(data[h.rank])
            x.copy_(data[h.rank])
            i = info(seq, x)
            h.start(i)
            hierarchical.all_reduce(h, i, x, ops.SUM)
            out.append(x.clone())
        return out

    res = sim.run(body)
    for k in range(3):
        assert all(torch.equal(res[0][k], res[r][k]) for r in range(4))
    assert torch.allclose(res[0][0], sum(data), atol=1e-4)
    assert torch.equal(res[0][0], res[0][1])  # same arithmetic with or without staging


def test_hierarchical_equals_flat_ring_within_tolerance():
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(100_000, generator=gen) for _ in range(4)]
    sim = Hosts(((0, 1), (2, 3)))

    def hier(h: HostTransports):
        x = data[h.rank].clone()
        h.start(info(1, x))
        hierarchical.all_reduce(h, info(1, x), x, Op("AVG"))
        return x

    def flat(t):
        x = data[t.rank].clone()
        t.start(info(1, x))
        ring.all_reduce(t, x, Op("AVG"))
        return x

    a = sim.run(hier)[0]
    b = run_ranks(4, flat)[0]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_subset_transport_maps_ranks():
    """A ring over ranks (1, 3) of a 4-rank world, addressed as 0 and 1."""
    def body(t):
        if t.rank not in (1, 3):
            return None
        sub = SubsetTransport(t, (1, 3))
        x = torch.full((10,), float(t.rank))
        sub.start(info(1, x))
        ring.all_reduce(sub, x, ops.SUM)
        return (sub.rank, sub.world_size, x)

    res = run_ranks(4, body)
    assert res[1][:2] == (0, 2) and res[3][:2] == (1, 2)
    assert torch.equal(res[1][2], torch.full((10,), 4.0))


def test_local_failure_names_group_ranks():
    """A host-local peer that never arrives: the error maps local ranks to group ranks."""
    sim = Hosts(((0, 1), (2, 3)), timeout=1.0)

    def body(h: HostTransports):
        if h.rank == 3:
            return None  # "dies" before the collective
        x = torch.ones(8)
        h.start(info(1, x))
        try:
            hierarchical.all_reduce(h, info(1, x), x, ops.SUM)
        except CollectiveError as exc:
            return str(exc)
        return "no error"

    text = sim.run(body, timeout=10)[2]
    assert "local 1 = rank 3" in text and "host 'h1'" in text, text
