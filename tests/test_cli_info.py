"""`tq-hf-cache info` says what a folder really holds: per-layer widths in layer order, the stored bits per
coordinate they spend, split keys and centring, where the calibration text came from; a missing folder is named."""

import json
import os
import re

import pytest
import transformers

from tq_hf_cache import TurboQuantConfig, cli
from tq_hf_cache.calibrate.allocation import bits_per_coordinate

ALLOCATIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                           "allocations")


def _info(capsys, folder) -> str:
    assert cli.main(["info", str(folder)]) == 0
    return capsys.readouterr().out


def _grid(out: str) -> dict[int, str]:
    """{layer: cell} from the 'bits per layer' rows ('  10-19  2/1 3/2 ...')."""
    cells = {}
    for line in out.splitlines():
        m = re.match(r"^\s+(\d+)(?:-(\d+))?  (\S.*)$", line)
        if m:
            first, last = int(m[1]), int(m[2] or m[1])
            row = m[3].split()
            assert len(row) == last - first + 1, line
            cells.update(zip(range(first, last + 1), row))
    return cells


def _save(folder, layers=12, **fields):
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                                   hidden_size=128, head_dim=64)
    TurboQuantConfig(**fields).save_pretrained(folder, model_config=cfg)
    return folder


def test_an_allocation_shows_its_widths_in_layer_order_and_what_they_spend(capsys):
    folder = os.path.join(ALLOCATIONS, "smollm2-2.5")
    with open(os.path.join(folder, "turboquant_config.json"), encoding="utf-8") as f:
        doc = json.load(f)
    layer_bits = {int(k): v for k, v in doc["tq_config"]["layer_bits"].items()}
    out = _info(capsys, folder)
    assert _grid(out) == {i: f"{k}/{v}" for i, (k, v) in layer_bits.items()}
    assert list(_grid(out)) == sorted(layer_bits)  # numeric: 2 before 10
    spent = bits_per_coordinate(layer_bits, doc["model"]["head_dim"])
    assert f"stored: {spent:.3f} bits per K/V coordinate" in out
    # the config's key_bits / value_bits name no layer here: they are not the folder's widths
    assert f"key {doc['tq_config']['key_bits']}, value {doc['tq_config']['value_bits']}" not in out
    assert f"budget {doc['bit_allocation']['budget']} bits per coordinate" in out


def test_layers_outside_layer_bits_and_skipped_layers_are_named(tmp_path, capsys):
    out = _info(capsys, _save(tmp_path, layer_bits={10: [2, 1], 2: [3, 2]}, skip_layers=[0], key_bits=4, value_bits=2))
    grid = _grid(out)
    assert list(grid) == list(range(12)) and grid[0] == "fp" and grid[2] == "3/2" and grid[10] == "2/1"
    assert "layers 1, 3-9, 11: key 4, value 2 (not in layer_bits)" in out
    assert "full precision: layer 0\n" in out
    plan = {i: [4, 2] for i in range(1, 12)} | {10: [2, 1], 2: [3, 2]}
    assert f"stored: {bits_per_coordinate(plan, 64):.3f} bits per K/V coordinate" in out


def test_a_uniform_config_shows_one_width(tmp_path, capsys):
    out = _info(capsys, _save(tmp_path, key_bits=3, value_bits=2, norm_dtype="float32"))
    assert "bits: key 3, value 2 in every layer" in out and "bits per layer" not in out
    assert f"stored: {bits_per_coordinate({0: [3, 2]}, 64, 'float32'):.3f} bits" in out
    assert "key centring: off" in out and "codebooks: theoretical" in out
    assert "codes: scalar (a codebook per coordinate)" in out and "norm correction off" in out


def test_pair_codes_and_norm_correction_are_shown(tmp_path, capsys):
    out = _info(capsys, _save(tmp_path, **TurboQuantConfig.from_preset("k4v2-pairs").to_dict()))
    assert "codes: pair (a 2-D codebook on each pair of coordinates), 3 code bits per coordinate; norm correction " \
        "on" in out and "key centring: on" in out


def test_split_keys_and_centring_are_shown_with_the_bits_they_spend(capsys):
    folder = os.path.join(ALLOCATIONS, "gemma3-270m-k4v2-split-c")
    with open(os.path.join(folder, "turboquant_config.json"), encoding="utf-8") as f:
        doc = json.load(f)
    tq, d = doc["tq_config"], doc["model"]["head_dim"]
    out = _info(capsys, folder)
    assert "key centring: on" in out
    layers = sorted(int(i) for i in tq["key_split"])
    spec = tq["key_split"][str(layers[0])]
    parts = " + ".join(f"{n}x{b}" for n, b in zip(spec["sizes"], spec["bits"]))
    assert f"split keys (channels x bits) in {len(layers)} layers: {parts} (layers {layers[0]}-{layers[-1]})" in out
    key_bytes = sum((n * b + 7) // 8 + 2 for n, b in zip(spec["sizes"], spec["bits"]))
    value_bytes = (d * tq["value_bits"] + 7) // 8 + 2
    assert f"stored: {(key_bytes + value_bytes) * 8 / (2 * d):.3f} bits" in out
    ksc = doc["key_split_calibration"]
    assert f"deltas {ksc['deltas']}" in out and f"from {ksc['base']}" in out


def test_missing_folder_and_file_are_named(tmp_path, capsys):
    assert cli.main(["info", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"{str(tmp_path / 'nope')!r} does not exist" in err and "no turboquant_config.json" not in err
    (tmp_path / "f").write_text("")
    assert cli.main(["info", str(tmp_path / "f")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli.main(["info", str(tmp_path)]) == 1  # a folder without the file
    assert "no turboquant_config.json" in capsys.readouterr().err


def test_calibration_text_is_shown_when_recorded_and_omitted_otherwise(tmp_path, capsys):
    import torch

    from conftest import tiny_llama_config
    from tq_hf_cache.calibrate.calibration import calibrate

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(3, 128, (2, 192), generator=torch.Generator().manual_seed(1))
    cb = calibrate(model, ids, TurboQuantConfig(key_bits=3, value_bits=2), progress=False)
    cb.save_pretrained(tmp_path / "plain")
    out = _info(capsys, tmp_path / "plain")
    assert f"fitted on {cb.info['num_tokens']} tokens\n" in out and "?" not in out
    cb.info["text_source"] = "my corpus.txt"
    cb.save_pretrained(tmp_path / "sourced")
    out = _info(capsys, tmp_path / "sourced")
    assert f"fitted on {cb.info['num_tokens']} tokens of my corpus.txt" in out


def test_json_carries_the_allocation_record(capsys):
    assert cli.main(["info", os.path.join(ALLOCATIONS, "smollm2-2.5"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "budget" in d["bit_allocation"] and d["tq_config"]["layer_bits"]
