"""`tq-hf-cache eval` checks every argument before loading a model, and ends with a summary table of what it
measured, per cache."""

import json

import pytest
import torch
import transformers

from tq_hf_cache import cli


def _no_model(*a, **k):
    raise AssertionError("the model was loaded before the arguments were checked")


@pytest.mark.parametrize("args, message", [
    (["--tasks", "ppl,perplexity"], "--tasks: unknown 'perplexity'; allowed: ppl, needle, agreement, bytes"),
    (["--tasks", ","], "--tasks: none given; allowed: ppl, needle, agreement, bytes"),
    (["--caches", "fp,k9v9"], "--caches: unknown 'k9v9'; allowed: "),
    (["--caches", ","], "--caches: none given"),
    (["--model", "/no/such/model"], "--model: model '/no/such/model' is neither a builtin"),
])
def test_eval_refuses_bad_arguments_before_loading(args, message, tmp_path, capsys, monkeypatch):
    import tq_hf_cache.tools.eval.models as models

    monkeypatch.setattr(models, "load_model", _no_model)
    rc = cli.main(["eval", "--output", str(tmp_path / "r.json"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "r.json").exists()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from test_calibration import _tiny_tokenizer

    from conftest import tiny_llama_config

    folder = tmp_path_factory.mktemp("tiny_eval")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).eval().save_pretrained(folder)
    _tiny_tokenizer(folder)
    return str(folder)


def test_eval_ends_with_a_summary_of_what_it_measured(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["eval", "--model", tiny_model_dir, "--caches", "fp,k4v2", "--tasks", "ppl,needle",
                   "--ppl-tokens", "300", "--chunk", "128", "--needle-lengths", "160", "--needle-depths", "0.5",
                   "--output", str(out)])
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out.splitlines()
    result = json.loads(out.read_text())
    head = next(i for i, line in enumerate(printed) if line.startswith("cache "))
    assert "ppl vs fp" in printed[head] and "needle found" in printed[head]
    assert "greedy prefix" not in printed[head] and "bits/coord" not in printed[head]  # not measured
    rows = {line.split()[0]: line for line in printed[head + 1:]
            if line.split() and line.split()[0] in result["caches"]}
    assert list(rows) == ["fp", "k4v2"]
    for name, line in rows.items():
        e = result["caches"][name]
        cells = line.split()
        assert cells[1] == f"{e['perplexity']['ppl']:.4f}" and cells[2] == f"{e['perplexity']['delta_pct']:+.2f}%"
        assert f"{e['needle']['found']}/{e['needle']['total']}" in cells
