"""The server role: per-key BSP aggregation of the pushes for the keys a server owns."""
