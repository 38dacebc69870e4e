"""The timeline study on the w32 variant: argv as fast_decode_timeline.py after the variant name."""
import os, runpy, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, ".dev/s31"); sys.path.insert(0, "benchmarks")
import ab_w32
ab_w32.setv(sys.argv[1])
src = ab_w32.fast.source()
ab_w32.fast.source = lambda: src
sys.argv = ["fast_decode_timeline.py"] + sys.argv[2:]
runpy.run_path("benchmarks/studies/fast_decode_timeline.py", run_name="__main__")
