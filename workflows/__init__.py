"""One DAG file per algorithm."""
