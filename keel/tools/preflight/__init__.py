"""`keel preflight`: measure and judge an allocation before a long run spends it.

Launched exactly like `keel train` (torchrun's API, srun, the deepspeed launcher); every rank measures
(run.py): clock offsets (clock.py), collectives per group kind and rank-pair links (collectives.py), a seeded
matmul and its speed (compute.py), the checkpoint directory (storage.py) and memory (memory.py). Rank 0 judges
the gathered measurements (judge.py), prints one table and writes `preflight.json` (report.py); every rank then
exits with the agreed code: 0 healthy, 9 (ExitCode.PREFLIGHT) with the bad ranks named.
"""
