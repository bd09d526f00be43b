"""Training: a run opened and checked (opening, preflight, micro_batch), its jitted step (step) and
evaluation, the loop (run), and the run directories it reads and writes (rundir)."""
