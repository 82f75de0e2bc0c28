"""Shared state between gateway replicas: their bookings and placements, over a bus (docs/design.md
"Shared state"; the wire format in :mod:`ext_proc.shared.wire`)."""
