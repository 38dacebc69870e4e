"""What a user runs (the `tq-hf-cache` CLI, bench, eval) and what it reads (texts, models). The runtime
never imports these."""
