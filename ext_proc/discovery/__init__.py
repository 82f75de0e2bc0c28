"""Discovery sources: where endpoint sets come from.

A source turns some external description of the cluster into
:class:`~ext_proc.endpoints.ClusterEndpoints` values and hands them to a callback: EDS files
(:class:`EdsFileSource`), the Kubernetes API's pods (:mod:`ext_proc.discovery.kubernetes`, the
pure pod rules in :mod:`ext_proc.discovery.pods`) or the pods of an InferencePool
(:mod:`ext_proc.discovery.inferencepool`). Nothing else in the server reads files or sockets
to learn endpoints. :mod:`~ext_proc.discovery.kinds` is the seam: the source protocol and the table of
its kinds.
"""

import enum

from ext_proc.discovery.eds import EdsError, load_eds_file
from ext_proc.discovery.eds_watch import EdsFileSource


class SourceKind(enum.StrEnum):
    """Where endpoints come from (config ``discovery.source``)."""

    FILES = "files"
    KUBERNETES = "kubernetes"
    INFERENCEPOOL = "inferencepool"


__all__ = ["EdsError", "EdsFileSource", "SourceKind", "load_eds_file"]
