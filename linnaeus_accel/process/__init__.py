"""The life of one training process, apart from its run directory: preemption signals, the
launcher it was started by, failures and which process had the first, fault points for tests, and
library notices kept off the console."""
