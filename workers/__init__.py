"""Per-node worker processes: consume the node stream, run jobs on providers, report back."""
