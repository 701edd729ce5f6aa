"""Object storage: where bundles (and, later, a run's durable checkpoints) live when they are not on a POSIX file
system. `url` parses and refuses store URLs; `base` is the small interface a backend offers; `s3` is the S3 one
(any S3-compatible store: its endpoint is configurable). There is no rename in a store: a writer's commit is the
object it writes last, conditionally (docs/OBJECT_STORAGE.md)."""
