"""What ``plan`` and the start of a run show of a resolved plan: the text summary, its timeline, the
schedule plot, the steps at which boundaries' events happen, the optimizer and validation-budget
lines. Reads the plan; resolves nothing."""
