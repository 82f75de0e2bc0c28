"""Shared state between gateway replicas: their bookings and placements, over a bus.

See docs/design.md "Shared state"; the wire format is :mod:`ext_proc.shared.wire`.
"""
