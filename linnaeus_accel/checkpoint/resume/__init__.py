"""Reading a checkpoint back into a run: finding the one to resume from, whether it fits this run
(layout, effective batch, config changes, optimizer groups), and what ``plan`` says of a resume."""
