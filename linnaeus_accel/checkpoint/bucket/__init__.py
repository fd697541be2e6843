"""The bucket's copy of the checkpoints (s3://, gs://, b2://, file://): uploads in the background, what
the bucket holds of each checkpoint, the catch-up after an outage, each machine's part of a
node-local checkpoint put together, and the newest checkpoint made whole on a machine's disk."""
