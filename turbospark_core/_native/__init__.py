"""Native helpers built at install time (optional: the runtime works without them)."""
