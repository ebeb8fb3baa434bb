"""The groups ``make test`` distributes over its pytest-xdist workers (tests/fixtures/parallel.py):
a module, every user of a shared service and the Ray tests each stay in one group."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.fixtures.parallel import RAY_MODULES, group_tests

pytestmark = pytest.mark.unit


@dataclass
class Item:
    nodeid: str
    fixturenames: tuple[str, ...] = ()
    marks: list[pytest.Mark] = field(default_factory=list)

    def iter_markers(self, name: str) -> list[pytest.Mark]:
        return [mark for mark in self.marks if mark.name == name]


def test_modules_stay_whole_and_unrelated_modules_stay_apart() -> None:
    items = [Item("tests/unit/test_a.py::one"), Item("tests/unit/test_b.py::one")]
    items.append(Item("tests/unit/test_a.py::two"))
    groups = group_tests(items)
    assert groups["tests/unit/test_a.py::one"] == "tests/unit/test_a.py"
    assert groups["tests/unit/test_a.py::two"] == "tests/unit/test_a.py"
    assert groups["tests/unit/test_b.py::one"] == "tests/unit/test_b.py"


def test_users_of_one_shared_server_join_one_group_even_through_a_mark_or_a_chain() -> None:
    uses_corpus = pytest.mark.uses_vllm("vllm_corpus_server").mark
    items = [
        Item("tests/integration/test_a.py::one", ("vllm_server",)),
        Item("tests/integration/test_b.py::one", ("gym_video_stack", "vllm_server")),
        Item("tests/integration/test_c.py::one", ("gym_video_stack",)),
        Item("tests/integration/test_d.py::one", marks=[uses_corpus]),
        Item("tests/integration/test_e.py::one", ("vllm_corpus_server",)),
        Item("tests/integration/test_f.py::one", ("tiny_qwen25vl",)),  # a session fixture, but no service
    ]
    groups = group_tests(items)
    assert {groups[i.nodeid] for i in items[:3]} == {"tests/integration/test_a.py"}
    assert groups[items[3].nodeid] == groups[items[4].nodeid] == "tests/integration/test_d.py"
    assert groups[items[5].nodeid] == "tests/integration/test_f.py"


def test_the_ray_modules_share_a_group() -> None:
    items = [Item(f"{module}::test") for module in RAY_MODULES]
    assert len(set(group_tests(items).values())) == 1
