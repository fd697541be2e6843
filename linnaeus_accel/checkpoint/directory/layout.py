"""The names of the files a run's checkpoint holds beside Accelerate's: what the store must know to
verify one (the journal is the one file allowed beyond its manifest) and what tells a checkpoint of
ours from another directory of weights (``MODEL.INIT_FROM``). Their contents: ``checkpoint.state.files``."""

STATE_FILE = "trainer_state.json"  # the run's own state, JSON
RANK_FILE = "rank_{:05d}.json"  # one per process
JOURNAL_FILE = "validation_journal.jsonl"  # appended after the commit: the passes that completed
