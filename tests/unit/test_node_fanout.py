"""The per-node fan-out's pure parts: what comes back from node runs, and which worker may run them."""

from __future__ import annotations

import pytest
from prefect.states import Completed, Failed

from flows.fanout import _reason, first_row
from flows.node import check_node
from hetrain.errors import HetrainError


def test_a_node_runs_failure_is_one_line_without_prefects_wrapping():
    state = Failed(message="Flow run encountered an exception: HetrainError: training failed (exit 1);\n  see log")
    assert _reason(state) == "training failed (exit 1); see log"
    assert _reason(Completed()) == "Completed"


@pytest.mark.parametrize("table, expected", [
    ('[{"node": "a", "steps": 3}]', {"node": "a", "steps": 3}),
    ([{"node": "a"}], {"node": "a"}),
    (None, {}), ("not json", {}), ('{"node": "a"}', {}), ('["a"]', {}), ("[]", {}),
])
def test_a_node_runs_table_is_read_defensively(table, expected):
    assert first_row({"table": table}) == expected


def test_node_flows_run_only_on_their_nodes_worker(monkeypatch):
    monkeypatch.setenv("HETRAIN_NODE", "a")
    check_node("a")
    with pytest.raises(HetrainError, match="this worker's machine is 'a'"):
        check_node("b")
    monkeypatch.delenv("HETRAIN_NODE")
    with pytest.raises(HetrainError, match="HETRAIN_NODE is unset"):
        check_node("a")
