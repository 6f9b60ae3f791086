"""Versioned training tables on Delta Lake: ingest with a pinned schema, versions, drift."""
