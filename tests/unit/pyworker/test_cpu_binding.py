"""vLLM-CPU's ranks on a machine of fewer NUMA nodes than ranks: the worker gives each
rank CPUs of its own, keeps an operator's binding, and refuses more ranks than CPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyworker import cpu_binding
from pyworker.cpu_binding import BIND_ENV, numa_nodes, parse_cpu_list, thread_binding
from pyworker.engine_args import EngineArgsError


def test_the_kernels_cpu_lists_parse() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == set()


def test_ranks_split_the_allowed_cpus_in_order_into_equal_groups() -> None:
    assert thread_binding(2, [0, 1], nodes=1) == "0|1"
    assert thread_binding(2, range(8), nodes=1) == "0-3|4-7"
    assert thread_binding(3, [0, 1, 2, 3, 4, 6, 7], nodes=1) == "0-2|3-4|6-7"
    assert thread_binding(4, [5, 1, 3, 2], nodes=2) == "1|2|3|5"
    assert thread_binding(2, [0, 2, 4, 6], nodes=1) == "0,2|4,6"  # gaps in what is allowed


def test_vllms_own_binding_is_kept_where_it_can_place_the_ranks() -> None:
    assert thread_binding(1, [0, 1], nodes=1) is None  # one rank: nothing to split
    assert thread_binding(2, range(64), nodes=2) is None  # a NUMA node per rank


def test_more_ranks_than_cpus_name_the_parallel_settings() -> None:
    with pytest.raises(EngineArgsError) as info:
        thread_binding(4, [0, 1], nodes=1)
    assert info.value.keys == ("tensor_parallel_size", "pipeline_parallel_size")
    assert "4 CPU ranks, but this process may run on 2 CPUs" in str(info.value)


def test_numa_nodes_count_those_holding_an_allowed_cpu(tmp_path: Path) -> None:
    for node, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node2", "")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-2\n")  # not a node
    assert numa_nodes(range(8), tmp_path) == 2
    assert numa_nodes([1, 2], tmp_path) == 1
    assert numa_nodes([0], tmp_path / "none") == 1  # the kernel says nothing


def test_an_operators_binding_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BIND_ENV, "nobind")
    assert cpu_binding.bind_cpu_ranks(2) is None
    monkeypatch.delenv(BIND_ENV)
    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_binding, "numa_nodes", lambda cpus: 1)
    assert cpu_binding.bind_cpu_ranks(2) == "0-1|2-3"
    assert cpu_binding.os.environ[BIND_ENV] == "0-1|2-3"
    monkeypatch.delenv(BIND_ENV)
