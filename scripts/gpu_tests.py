"""Run the tests that exercise the GPU paths (the CUDA and Triton decode kernels, the kernel selection, the static
cache's compiled step, the norm guard, the prefix store's GPU tier) on a CUDA machine, and write what they gave as
JSON naming the commit and the GPU: the record a session that changes a kernel leaves.

    python scripts/gpu_tests.py --commit $(git rev-parse --short HEAD) --out DIR      # writes DIR/gpu_tests.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

FILES = ["test_select.py", "test_fast_decode.py", "test_pair_codes.py", "test_reliability.py", "test_decode_attention.py",
         "test_norms_and_mean.py", "test_static_cache.py", "test_static_attention.py", "test_kernels_quantize.py",
         "test_host_waits.py", "test_cache_lifecycle.py", "test_compile.py", "test_prefix_store.py",
         "test_prefix_store_faults.py", "test_derived.py", "test_key_centering.py"]  # the kernel selection and the kernels first: a time limit cuts the rest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--commit", required=True, help="the commit the tree is at (the device copy has no .git)")
    p.add_argument("--out", required=True)
    p.add_argument("--limit-s", type=float, default=None, help="interrupt the run after this long (what ran is kept)")
    p.add_argument("files", nargs="*", default=FILES, help="test files under tests/ (default: all of FILES)")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_tests: no CUDA device here", file=sys.stderr)
        return 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    xml = os.path.join(a.out, "gpu_tests.xml")
    t = time.time()
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
                            f"--junitxml={xml}", *[os.path.join("tests", f) for f in a.files]], cwd=root)
    interrupted = False
    try:
        run.wait(a.limit_s)
    except subprocess.TimeoutExpired:  # pytest ends the session on SIGINT and still writes its report
        interrupted = True
        run.send_signal(signal.SIGINT)
        run.wait()
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (el.get("message") or "")[:300]
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      **({"detail": detail} if outcome != "passed" else {})})
    os.remove(xml)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    res = {"commit": a.commit, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "seconds": round(time.time() - t, 1), "files": a.files, "interrupted_at_limit": interrupted,
           "counts": counts,
           "not_passed": [c for c in cases if c["outcome"] != "passed"]}
    with open(os.path.join(a.out, "gpu_tests.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(counts))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
