"""pd-extproc as Envoy's EDS server.

The ADS protocol (:mod:`~ext_proc.xds.ads`) and the publisher that orders every endpoint change
between Envoy and the router (:mod:`~ext_proc.xds.publisher`). This module imports nothing: the
configuration (:mod:`~ext_proc.xds.config`) loads without gRPC.
"""
