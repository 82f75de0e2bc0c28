"""Flow control: requests wait here while the pool is saturated, by priority band, fairly between tenants.

Off by default (``flow_control.enabled``; docs/operations.md "Flow control"). The pure parts:
:mod:`~ext_proc.flow.queue` (bands, deficit round-robin on tokens between the flows of a band, the
bounds), :mod:`~ext_proc.flow.classify` (a request's band and flow from its headers) and
:mod:`~ext_proc.flow.saturation` (the Gateway API Inference Extension's rule on the engines' signals).
The shell: :mod:`~ext_proc.flow.control` (the waiters' futures, dispatch, timeouts) and
:mod:`~ext_proc.flow.metrics`. The stream (:mod:`ext_proc.stream`) asks it for a slot once a body is
read, and routes a dispatched request on the load of that moment.
"""
