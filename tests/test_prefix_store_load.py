"""The load-and-fault harness (benchmarks/prefix_store_load.py), small: 8 threads serving requests while writes fail
and page files are deleted, truncated and damaged, a second process asks for the folder, a server is killed mid-insert
and a new store adopts its folder. No wrong restore, no error but the documented ones, no stuck prompt, every folder
within its budget."""

import importlib.util
import os

import pytest


@pytest.mark.slow
def test_the_store_under_load_and_faults_gives_no_wrong_result():
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "prefix_store_load.py")
    spec = importlib.util.spec_from_file_location("prefix_store_load", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    res = harness.main(["--phases", "load,restart", "--threads", "8", "--requests", "6", "--users", "8",
                        "--fault-rate", "0.1", "--fault-every", "0.03"])
    load, restart, budget = res["load"], res["restart"], res["budgets"]["disk"]
    assert load["requests"] == 48 and load["wrong"] == 0 and load["other_errors"] == 0, load
    assert sum(load["faults"].values()) > 10 and load["inserts_rolled_back"] == load["insert_oserror"]
    assert res["second_process"] == "refused"
    assert res["stuck_prompts"]["after_two_requests"] == 0
    assert load["disk_file_bytes"] <= budget and res["after_load_disk_file_bytes"] <= budget
    assert restart["child_started"] and restart["wrong"] == 0 and restart["other_errors"] == 0, restart
    assert restart["hits"] > 0 and restart["disk_file_bytes"] <= budget
