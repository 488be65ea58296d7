"""The server role: aggregates the pushes for the keys it owns (arrives with the runtime)."""
