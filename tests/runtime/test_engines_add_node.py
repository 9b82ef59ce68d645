"""`engines add N --node NODE` against a run whose engines are local (trainer.nnodes=1): refused in one line naming
why, through the real CLI client, a real `ControlServer` and the real `ElasticEngines.apply` and
`EngineSupervisor.add_slot` (runtime/run/elastic.py, engines/supervisor.py). The launcher is a real, unstarted
`EngineLauncher`: a refused request starts nothing. Placing on a cluster node for real is
tests/runtime/test_cluster_placement.py.
"""

from __future__ import annotations

import threading

import pytest
from test_elastic_control import actorless_context

from rllm.experimental.fully_async.cli.engines import RefusedError, main
from rllm.experimental.fully_async.core.elastic import ElasticError, parse_request
from rllm.experimental.fully_async.engines import EmbeddedEngineCommand, EngineLauncher
from rllm.experimental.fully_async.engines.supervisor import EngineSupervisor
from rllm.experimental.fully_async.runtime.run.elastic import ElasticEngines

pytestmark = pytest.mark.timeout(60)


def test_a_local_run_refuses_engines_add_with_a_node_in_one_line(tmp_path, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launcher = EngineLauncher(EmbeddedEngineCommand(str(tiny_model_dir), num_threads=1), 1, log_dir=tmp_path)
    elastic = ElasticEngines(actorless_context(run_dir, str(tiny_model_dir), EngineSupervisor(launcher, "restart")), [])
    elastic.start()
    seen: list[dict] = []

    def driver() -> None:  # the driver's watch, for one request
        body, answer = elastic.control.requests.get(timeout=30)
        seen.append(body)
        answer.set_result(elastic.apply(body))

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    try:
        with pytest.raises(RefusedError) as caught:
            main(["add", "2", "--node", "abc123", "--run-dir", str(run_dir)])
    finally:
        thread.join(timeout=30)
        elastic.close()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("engines add --node abc123: this run's engines are local")
    assert "(trainer.nnodes=1)" in message and "drop --node" in message
    assert seen == [{"op": "add", "count": 2, "node": "abc123"}]  # the CLI sent the node
    assert launcher.processes == [] and elastic.membership.listing() == []  # the run unchanged: nothing started


def test_a_node_must_be_a_non_empty_string():
    assert parse_request({"op": "add", "count": 1}).node is None
    assert parse_request({"op": "add", "count": 1, "node": "10.0.0.2"}).node == "10.0.0.2"
    for bad in ("", 3):
        with pytest.raises(ElasticError, match=r"engines add --node: NODE must be a node id"):
            parse_request({"op": "add", "count": 1, "node": bad})
