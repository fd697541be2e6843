"""linnaeus-accel: linnaeus' training-progress and scheduling system on Hugging Face Accelerate."""

__version__ = "0.1.0"
