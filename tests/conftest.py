import os

# Tests run on 2 cores; keep torch from oversubscribing when several processes run at once.
os.environ.setdefault("OMP_NUM_THREADS", "2")
