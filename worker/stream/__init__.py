"""Stream training's sources: timestamped events from a replayed file or a Redis stream, read in mini-batches."""
