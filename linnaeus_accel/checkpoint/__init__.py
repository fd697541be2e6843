"""Everything of a run's checkpoints, in one room. The loop's one door is ``manager.CheckpointManager``
(save, resume, roll back); behind it:

- ``directory/``: the checkpoint directory on disk: staging, the atomic commit with a manifest of
  digests (``COMMITTED.json``), verification, retention, rejection. Knows files, not training.
- ``state/``: a run's state as plain data: the registry of stateful parts, their encoding, the
  files a checkpoint holds and what they may contain, the validation journal.
- ``save/``: writing a checkpoint (every process stages, the main process commits in the
  background), host snapshots for ASYNC checkpoints, a failed write, a NaN never committed.
- ``resume/``: reading one back: which checkpoint, whether it fits this run, what changed.
- ``bucket/``: the copy in an object store, its uploads, a node-local run's parts.
- ``init_from.py``: weights from a checkpoint (or another model's files) for ``MODEL.INIT_FROM``.
"""
