"""Nsight Compute counters of one decode attention call (Llama-3.1-8B layer, --shape for others, one query): the
Triton kernel (before) and the explicit-layout kernel (after) on the same packed layer, for the issue's questions:
achieved DRAM throughput, warps per scheduler (active, eligible, issuing) and the top stall reasons (cycles a warp
spends stalled per issued instruction, by reason); with --shared also the instructions executed and the
shared-memory loads' instructions, wavefronts and bank conflicts.

`--kernel fast|triton` runs the workload (three calls; ncu takes the third); without it, the script runs ncu on
both, with the SM clock left alone (`--clock-control none`), and writes F (JSON).
Usage:
    python benchmarks/studies/ncu_decode.py [--case 1x131072] [--preset k5v3] [--shape llama-3.1-8b] [--shared]
        --out F
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time

STALLS = ("long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle", "mio_throttle", "not_selected",
          "selected", "barrier", "lg_throttle", "no_instruction", "dispatch_stall", "branch_resolving", "membar",
          "drain", "sleeping", "tex_throttle", "imc_miss", "misc")
METRICS = {
    "duration_us": "gpu__time_duration.sum",
    "sm_clock_ghz": "smsp__cycles_elapsed.avg.per_second",
    "dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_read_GBps": "dram__bytes_read.sum.per_second",
    "active_warps_per_scheduler": "smsp__warps_active.avg.per_cycle_active",
    "eligible_warps_per_scheduler": "smsp__warps_eligible.avg.per_cycle_active",
    "issued_per_scheduler_cycle": "smsp__issue_active.avg.per_cycle_active",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers_per_thread": "launch__registers_per_thread",
    "grid_size": "launch__grid_size",
    "block_size": "launch__block_size",
    **{f"stall_{s}": f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS},
}
KERNELS = {"fast": "tq_decode", "triton": "_decode_kernel"}
# --shared: the shared-memory loads' instructions, wavefronts and bank conflicts too
SHARED = {"inst_executed": "smsp__inst_executed.sum",
          "shared_ld_instructions": "smsp__inst_executed_op_shared_ld.sum",
          "shared_ld_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
          "shared_ld_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"}


def workload(kind: str, case: str, preset: str, shape: str) -> None:
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import bench_attention as ba
    from tq_hf_cache.kernels import decode_attention as da

    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, case.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, _ = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        da.decode_attention(q, kv, fast=kind == "fast")
    torch.cuda.synchronize()


def profile(kind: str, case: str, preset: str, shape: str, metrics: dict) -> dict:
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", KERNELS[kind], "--launch-skip", "2", "--launch-count",
           "1", "--csv", "--page", "raw", "--metrics", ",".join(metrics.values()),
           sys.executable, os.path.abspath(__file__), "--kernel", kind, "--case", case, "--preset", preset,
           "--shape", shape]
    res = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith('"')]
    if res.returncode or len(lines) < 3:
        raise SystemExit(f"ncu failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    head, units, vals = rows[0], rows[1], rows[2]
    raw = dict(zip(head, vals))
    unit = dict(zip(head, units))
    out = {}
    for name, metric in metrics.items():
        v = raw.get(metric, "").replace(",", "")
        try:
            x = float(v)
        except ValueError:
            out[name] = None
            continue
        u = unit.get(metric, "")
        if name == "duration_us":
            x *= {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[u]
        elif name == "sm_clock_ghz":
            x *= {"hz": 1e-9, "Hz": 1e-9, "cycle/second": 1e-9, "KHz": 1e-6, "MHz": 1e-3, "GHz": 1.0,
                  "cycle/nsecond": 1.0}[u]
        elif name == "dram_read_GBps":
            x *= {"byte/s": 1e-9, "byte/second": 1e-9, "Kbyte/s": 1e-6, "Kbyte/second": 1e-6, "Mbyte/s": 1e-3,
                  "Mbyte/second": 1e-3, "Gbyte/s": 1.0, "Gbyte/second": 1.0, "Tbyte/s": 1e3, "Tbyte/second": 1e3}[u]
        out[name] = round(x, 3)
    stalls = {k[6:]: v for k, v in out.items() if k.startswith("stall_") and v is not None}
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
    return {"kernel": KERNELS[kind], **{k: v for k, v in out.items() if not k.startswith("stall_")},
            "top_stalls_cycles_per_issued_instruction": dict(top), "all_stalls": stalls}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=sorted(KERNELS))
    ap.add_argument("--case", default="1x131072")
    ap.add_argument("--preset", default="k5v3")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--shared", action="store_true", help="also the shared-memory loads' wavefronts and conflicts")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.kernel:
        workload(a.kernel, a.case, a.preset, a.shape)
        return
    import torch

    metrics = {**METRICS, **(SHARED if a.shared else {})}
    result = dict(what=f"ncu of one decode attention call, {a.case}, {a.preset}, {a.shape} layer, one query",
                  device=torch.cuda.get_device_name(), torch=torch.__version__, when=time.strftime("%Y-%m-%d %H:%M"),
                  command=" ".join(["python", "benchmarks/studies/ncu_decode.py"] + sys.argv[1:]),
                  before=profile("triton", a.case, a.preset, a.shape, metrics),
                  after=profile("fast", a.case, a.preset, a.shape, metrics))
    for k in ("before", "after"):
        r = result[k]
        print(f"{k} ({r['kernel']}): {r['duration_us']} us, DRAM {r['dram_throughput_pct']} %, warps/scheduler "
              f"active {r['active_warps_per_scheduler']} eligible {r['eligible_warps_per_scheduler']} issue "
              f"{r['issued_per_scheduler_cycle']}; stalls {r['top_stalls_cycles_per_issued_instruction']}")
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
