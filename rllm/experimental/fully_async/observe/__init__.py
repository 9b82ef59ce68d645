"""What a user sees of a run: the metrics sink, the progress line and the run summary."""
