# What a run keeps on disk: the run store (SQLite), the model checkpoints, the update spool, initial weight files.
