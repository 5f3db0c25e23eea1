"""What tests (and the trainer's start-up self-check) need of the ops, apart from the runtime: the
parity samples, error cases and benchmark shapes of each op (cases/<op>.py), the sample building
blocks (samples.py), the one comparison helper and tolerance table (compare.py, tolerances.py),
the parity check and self-check (check.py) and the routing near-ties of layer ops (ties.py).
The runtime (v4train.ops, v4train.models, the trainer's step) never imports it, but for the
self-check the trainer runs before training."""
