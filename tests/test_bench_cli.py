"""`tq-hf-cache bench` on a tiny random Llama saved to a folder (CPU): every row runs, the JSON and plot are written,
ratios are against the fastest full-precision row, and bad arguments are refused before any model loads."""

import json
import statistics

import pytest
import torch
import transformers

from tq_hf_cache import cli


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    return str(folder)


def test_bench_writes_rows_ratios_and_plot(tiny_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--model", tiny_dir, "--device", "cpu", "--contexts", "40,300", "--steps", "3",
                   "--repeats", "3", "--warmup", "1", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    rows = {(r["row"], r["context"]): r for r in res["rows"]}
    assert set(rows) == {(r, c) for r in ("dynamic", "tq_sdpa", "tq_fused") for c in (40, 300)}
    for r in rows.values():
        assert r["wall_ms"] > 0 and r["cache_MiB"] > 0, r
    for c in (40, 300):
        assert rows[("dynamic", c)]["vs_best_baseline"] == 1.0
        assert rows[("dynamic", c)]["agree"] == 1.0
    # 40 tokens stay in the residual window: nothing is quantized, so the greedy tokens are DynamicCache's
    assert rows[("tq_sdpa", 40)]["agree"] == rows[("tq_fused", 40)]["agree"] == 1.0
    # at 300 tokens the history is packed: fewer bytes than DynamicCache
    assert rows[("tq_fused", 300)]["cache_MiB"] < rows[("dynamic", 300)]["cache_MiB"]
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert res["env"]["preset"] == "k5v3"


@pytest.mark.parametrize("argv, message", [
    (["--rows", "static_compiled"], "need CUDA"),
    (["--rows", "fastest"], "unknown bench rows"),
    (["--contexts", "0"], "--contexts must be"),
    (["--contexts", "a,b"], "--contexts must be"),
    (["--steps", "0"], "--steps must be an integer >= 3"),
    (["--warmup", "0", "--steps", "1"], "--steps must be an integer >= 3"),
    (["--steps", "2"], "--steps must be an integer >= 3"),
    (["--warmup", "0"], "--warmup must be an integer >= 1"),
    (["--repeats", "2"], "--repeats must be an integer >= 3"),
    (["--batch", "0"], "--batch must be an integer >= 1"),
    (["--model", "/no/such/folder"], "is not a folder"),
    (["--model", "llama-3.1-8b"], "needs --device cuda"),
    (["--device", "gpu0"], "--device must be cuda, cpu or auto"),
])
def test_bench_refuses_bad_arguments(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load_model", _no_model)
    rc = cli.main(["bench", "--device", "cpu", "--out", str(tmp_path / "x.json"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not (tmp_path / "x.json").exists()


def test_bench_asks_compiled_rows_for_the_warmup_they_need(monkeypatch, capsys):
    from tq_hf_cache import bench

    with pytest.raises(ValueError, match=r"--warmup must be an integer >= 3 \(compiled rows"):
        bench.check_counts(10, 1, 5, ["dynamic", "static_compiled"])
    bench.check_counts(10, 1, 5, ["dynamic", "tq_fused"])


def test_rows_are_interleaved_and_ratios_taken_per_repetition(tiny_dir, monkeypatch):
    """A machine that slows down between repetitions: every row sees the same drift, so each repetition's ratio is
    the rows' true ratio, while the ms per row spread with the drift."""
    from tq_hf_cache import bench

    rows, repeats, steps = ["dynamic", "tq_sdpa", "tq_fused"], 4, 3
    cost = {"dynamic": 1.0, "tq_sdpa": 3.0, "tq_fused": 2.0}
    drift = [1.0, 2.0, 1.5, 4.0]
    calls = []

    def fake_time_steps(self, n):
        assert n == steps
        calls.append(self.row)
        return [cost[self.row] * drift[(len(calls) - 1) // len(rows)]] * n

    monkeypatch.setattr(bench._Prepared, "time_steps", fake_time_steps)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    res = bench.decode_bench(model, rows, [40], steps=steps, warmup=1, repeats=repeats, progress=False)
    per_rep = [calls[i * len(rows): (i + 1) * len(rows)] for i in range(repeats)]
    assert all(sorted(rep) == sorted(rows) for rep in per_rep)  # every repetition times every row once
    assert {rep[0] for rep in per_rep} == set(rows)  # the order rotates: each row goes first in turn
    by_row = {r["row"]: r for r in res}
    for row in rows:
        r = by_row[row]
        ms = [cost[row] * d for d in drift]
        assert r["wall_ms_reps"] == pytest.approx(ms) and r["wall_ms"] == pytest.approx(statistics.median(ms))
        assert r["spread_pct"] == pytest.approx(100 * (max(ms) - min(ms)) / r["wall_ms"], abs=0.1)
        ratio = cost[row] / cost["dynamic"]
        assert r["vs_best_baseline"] == pytest.approx(ratio) and r["vs_best_baseline_range"] == pytest.approx([ratio] * 2)
        assert r["agree"] == 1.0  # every row decoded the same number of greedy tokens


def test_the_plot_names_rows_in_user_terms_with_model_preset_and_context(tiny_dir, tmp_path, monkeypatch, capsys):
    from tq_hf_cache import bench

    seen = {}
    monkeypatch.setattr(bench, "plot", lambda results, path, title: seen.update(results=results, title=title))
    rc = cli.main(["bench", "--model", tiny_dir, "--device", "cpu", "--contexts", "40", "--steps", "3", "--repeats",
                   "3", "--warmup", "1", "--preset", "k4v2", "--out", str(tmp_path / "b.json"), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    labels = {r["row"]: r["label"] for r in seen["results"]}
    assert labels == {"dynamic": "DynamicCache + sdpa", "tq_sdpa": "TurboQuantCache k4v2 (fused_sdpa=False) + sdpa",
                      "tq_fused": "TurboQuantCache k4v2 + turboquant attention"}
    assert all(label in printed for label in labels.values())
    for part in ("tiny_llama", "preset k4v2", "contexts 40 tokens"):
        assert part in seen["title"], seen["title"]


def test_bench_refuses_contexts_beyond_the_model(tiny_dir, tmp_path, capsys):
    rc = cli.main(["bench", "--model", tiny_dir, "--device", "cpu", "--contexts", "2000", "--out",
                   str(tmp_path / "x.json")])
    assert rc == 2 and "max_position_embeddings (1024)" in capsys.readouterr().err


def _no_model(*a, **k):
    raise AssertionError("the model was loaded before the output paths were checked")


@pytest.mark.parametrize("out, message", [
    ("{DIR}", "--out '{DIR}' is a folder"),
    ("{DIR}/x.png", "is where the plot goes"),
    ("{PLOTDIR}.json", "--out's plot (beside it) '{PLOTDIR}.png' is a folder"),
    ("{FILE}/x.json", "cannot write into its folder"),
])
def test_bench_checks_its_output_paths_before_any_work(out, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "PLOTDIR.png").mkdir()
    (tmp_path / "FILE").write_text("")
    monkeypatch.setattr(cli, "_load_model", _no_model)
    subs = {"DIR": str(tmp_path), "PLOTDIR": str(tmp_path / "PLOTDIR"), "FILE": str(tmp_path / "FILE")}
    rc = cli.main(["bench", "--device", "cpu", "--out", out.format(**subs), "--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and message.format(**subs) in err and "Traceback" not in err, err


@pytest.mark.parametrize("args, message", [
    (["--output", "{DIR}"], "--output '{DIR}' is a folder"),
    (["--plot", "{DIR}"], "--plot '{DIR}' must name a .png file"),
    (["--plot", "{DIR}/sub.png"], "--plot '{DIR}/sub.png' is a folder"),
    (["--markdown", "{DIR}"], "--markdown '{DIR}' is a folder"),
    (["--output", "{FILE}/r.json"], "--output '{FILE}/r.json': cannot write into its folder"),
    (["--output", "{DIR}/a.json", "--markdown", "{DIR}/a.json"], "must name different files"),
])
def test_eval_checks_its_output_paths_before_any_work(args, message, tmp_path, capsys, monkeypatch):
    import tq_hf_cache.tools.eval.models as models

    (tmp_path / "sub.png").mkdir()
    (tmp_path / "FILE").write_text("")
    monkeypatch.setattr(models, "load_model", _no_model)
    monkeypatch.chdir(tmp_path)
    subs = {"DIR": str(tmp_path), "FILE": str(tmp_path / "FILE")}
    args = [a.format(**subs) for a in args]
    rc = cli.main(["eval", "--caches", "fp", "--tasks", "bytes", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message.format(**subs) in err and "Traceback" not in err, err
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_bench_decode_tp_mode_over_two_ranks_and_its_merge(tmp_path):
    """benchmarks/bench_decode.py --tp on CPU over 2 gloo ranks (rows that run there): each rank holds half the KV
    heads, rank 0 writes both ranks' bytes, the ranks exit, and --plot_tp merges world sizes into one JSON and a PNG
    (refusing a row measured twice)."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), os.pardir)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = os.path.join(root, "benchmarks", "bench_decode.py")
    args = ["--tp", "--model", str(tmp_path / "m"), "--rows", "dynamic,tq_fused", "--contexts", "200", "--steps", "3",
            "--warmup", "1", "--chunk", "64"]
    for n in (1, 2):
        out = tmp_path / f"w{n}"
        out.mkdir()
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), script, *args,
                              "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    two = json.loads((tmp_path / "w2" / "bench_decode_tp2.json").read_text())
    one = json.loads((tmp_path / "w1" / "bench_decode_tp1.json").read_text())
    assert two["env"]["world_size"] == 2 and [r["row"] for r in two["rows"]] == ["dynamic", "tq_fused"]
    for r1, r2 in zip(one["rows"], two["rows"]):
        assert len(r2["cache_MiB_per_rank"]) == 2 and r2["cache_MiB_per_rank"][0] == r2["cache_MiB_per_rank"][1]
        assert r2["cache_MiB_per_rank"][0] < r1["cache_MiB_per_rank"][0]  # half the heads on each rank
    files = f"{tmp_path / 'w1' / 'bench_decode_tp1.json'},{tmp_path / 'w2' / 'bench_decode_tp2.json'}"
    subprocess.run([sys.executable, script, "--plot_tp", files, "--out", str(tmp_path)], check=True, env=env,
                   capture_output=True, timeout=120)
    merged = json.loads((tmp_path / "bench_decode_tp.json").read_text())
    assert [r["env"]["world_size"] for r in merged["runs"]] == [1, 2] and (tmp_path / "bench_decode_tp.png").exists()
    twice = subprocess.run([sys.executable, script, "--plot_tp", f"{files},{tmp_path / 'w2' / 'bench_decode_tp2.json'}",
                            "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert twice.returncode != 0 and "measured twice" in twice.stderr
