"""What the daemon keeps on disk across restarts, per principal: the snapshot store
(snapshots.py), the durable runs and their files (parkedruns.py) and their journals and
quotas (journal.py). A wing: it imports the pure core, never the shell."""
