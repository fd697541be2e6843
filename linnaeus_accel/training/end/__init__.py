"""How a run ends: the last checkpoint committed, ``final/`` written for others to load, the summary,
and what each process says when a peer failed."""
