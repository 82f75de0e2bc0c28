"""The Helm chart's RBAC for ``discovery.source: inferencepool``: get/list/watch on pods and on
InferencePools, in the pool's namespace (the real Helm and the Kubernetes schemas, as in
``test_helm_chart``)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
from helm_chart import FULLNAME, KUBE_VERSIONS, NAMESPACE, Manifests, template

RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch"],
    },
]


@pytest.mark.parametrize(("pool_namespace", "expected"), [("", NAMESPACE), ("models", "models")])
def test_a_role_in_the_pools_namespace_grants_pods_and_inferencepools(
    helm: Path, tmp_path: Path, pool_namespace: str, expected: str
) -> None:
    discovery = {
        "source": "inferencepool",
        "inferencepool": {"name": "llama", "namespace": pool_namespace},
        "kubernetes": {"namespaces": ["a", "b"]},  # not used by this source
    }
    manifests = Manifests(template(helm, tmp_path, {"discovery": discovery}))
    (role,) = manifests.all("Role")
    assert manifests.all("ClusterRole") == []
    assert (role["metadata"]["name"], role["metadata"]["namespace"]) == (FULLNAME, expected)
    assert role["rules"] == RULES
    (binding,) = manifests.all("RoleBinding")
    assert binding["metadata"]["namespace"] == expected
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": FULLNAME}
    account = manifests.one("ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    for doc in (role, binding):
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
    assert manifests.pod["automountServiceAccountToken"] is True
    assert manifests.all("InferencePool") == []  # gateway mode: a pool deployed apart from the chart


def test_the_kubernetes_source_is_not_granted_inferencepools(helm: Path, tmp_path: Path) -> None:
    manifests = Manifests(template(helm, tmp_path, {"discovery": {"source": "kubernetes"}}))
    (role,) = manifests.all("Role")
    assert role["rules"] == RULES[:1]
