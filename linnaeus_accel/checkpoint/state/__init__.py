"""A run's state as plain data: the registry of the parts that hold state, how their state is
encoded (JSON and safetensors, never pickled), the files a checkpoint holds and what they may
contain, the validation journal, and a LoRA model's frozen base."""
