"""Discovery sources: where endpoint sets come from.

A source turns some external description of the cluster (EDS files today; an xDS client or the
Kubernetes API later) into :class:`~ext_proc.discovery.eds.ClusterEndpoints` values and hands
them to a callback. Nothing else in the server reads files or sockets to learn endpoints.
"""

from ext_proc.discovery.eds import ClusterEndpoints, EdsError, EndpointSpec, load_eds_file
from ext_proc.discovery.eds_watch import EdsFileSource

__all__ = ["ClusterEndpoints", "EdsError", "EdsFileSource", "EndpointSpec", "load_eds_file"]
