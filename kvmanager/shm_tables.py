"""Where the shared-memory block tables were; they are the scheduler's and the workers' shared
mechanism now (pagedserve/shm_tables.py), so a worker loads no kvmanager module. Kept for
importers not yet moved."""
from pagedserve.shm_tables import NAME_PREFIX, SharedBlockTables

__all__ = ["NAME_PREFIX", "SharedBlockTables"]
