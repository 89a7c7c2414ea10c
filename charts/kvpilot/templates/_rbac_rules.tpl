{{/*
What the operator calls, and nothing more: tests/operator/test_rbac.py runs the operator with
its ServiceAccount's token against a real API server and reads the API server's audit log; every
call must be allowed (no 403) and every rule used.
"kvpilot.namespacedRules": what it does inside the namespaces it watches;
"kvpilot.secretRules": reading a hub token Secret (spec.model.hfTokenSecretRef) to size a gated
  model; granted per watched namespace, or cluster-wide only for the names in rbac.secretNames;
"kvpilot.clusterRules": what kopf needs at cluster scope when it scans (every namespace, or
  namespace globs such as team-*): the CRD, and the namespaces a glob matches.
kopf runs standalone (no peering), so no kopfpeerings rules.
*/}}
{{- define "kvpilot.namespacedRules" -}}
# kopf watches LLMDeployments and patches them (its last-handled state annotations); a change
# to an engine Deployment makes the handler get its owner.
- apiGroups: ["kvpilot.dev"]
  resources: ["llmdeployments"]
  verbs: ["get", "list", "watch", "patch"]
# Conditions, plan and replicas are written through the status subresource.
- apiGroups: ["kvpilot.dev"]
  resources: ["llmdeployments/status"]
  verbs: ["patch"]
# The autoscaler writes spec.replicas through the scale subresource, as HPA does.
- apiGroups: ["kvpilot.dev"]
  resources: ["llmdeployments/scale"]
  verbs: ["patch"]
# Children carry ownerReferences with blockOwnerDeletion: with the
# OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) that needs update on
# the owner's finalizers, though the operator never sets one.
- apiGroups: ["kvpilot.dev"]
  resources: ["llmdeployments/finalizers"]
  verbs: ["update"]
# Children, written with server-side apply (a patch, and a create for the first one): the
# garbage collector deletes them with their parent. Deployments are also watched (by label),
# so a child's change triggers a reconcile.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Multi-node replicas (a plan with pipeline parallelism across nodes) are LeaderWorkerSets,
# written and watched like the Deployments; used only where the LWS CRD is installed.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
# The model cache claim, for spec.modelCache with a storage class (its size patched to expand).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
# The engine pods (by label): the autoscaler scrapes the ready ones' /metrics; unschedulable
# or failing ones are reported in the LLMDeployment's conditions. Before a scale-down their
# controller.kubernetes.io/pod-deletion-cost annotations name the pods to remove (a patch).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
{{- if .Values.router.enabled }}
# The router of each LLMDeployment runs as a ServiceAccount of its own, bound to a Role of what
# it calls (list/watch pods; list/watch/patch its LLMDeployment). RBAC lets the operator grant
# only what it holds itself, which it does (the pods and llmdeployments rules above).
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
{{- end }}
# Events for decisions and errors (the handlers' own, and kopf's warnings).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{- define "kvpilot.secretRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- end }}

{{- define "kvpilot.clusterRules" -}}
# kopf follows the CRD (added, removed, new versions) to start and stop its watches.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if include "kvpilot.namespaceGlobs" . }}
# Namespace globs (operator.watchNamespaces): kopf follows the namespaces that match them.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/* "true" when operator.watchNamespaces holds a kopf glob (*, ? or [...]), else empty. */}}
{{- define "kvpilot.namespaceGlobs" -}}
{{- range .Values.operator.watchNamespaces }}{{ if regexMatch "[*?\\[]" . }}true{{ end }}{{ end }}
{{- end }}
