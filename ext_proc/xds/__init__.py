"""pd-extproc as Envoy's EDS server.

The ADS protocol (:mod:`~ext_proc.xds.ads`) and the publisher that orders every endpoint change
between Envoy and the router (:mod:`~ext_proc.xds.publisher`)."""

from ext_proc.xds.ads import AdsServer
from ext_proc.xds.publisher import EdsPublisher

__all__ = ["AdsServer", "EdsPublisher"]
