"""A run's checkpoint and resume machinery on Accelerate: saving (saver), the state files and their
schemas, finding the resume point, elastic layout changes, host snapshots, the validation journal,
config-change review. The checkpoint store itself (atomic commit, verification) is ``checkpoint/``,
free of torch and Accelerate."""
