{{/*
What the operator calls, and nothing more (tests/operator/test_rbac.py records every call the
operator makes against the API emulator and checks it against these rules).
"kvpilot.namespacedRules": what it does inside the namespaces it watches;
"kvpilot.clusterRules": what kopf needs at cluster scope to follow the CRD, when it watches
every namespace (with --namespace, kvpilot runs kopf with cluster scanning off).
kopf runs standalone (no peering), so no kopfpeerings rules.
*/}}
{{- define "kvpilot.namespacedRules" -}}
# kopf watches LLMDeployments and patches them (finalizer, last-handled state annotations);
# a change to an engine Deployment makes the handler get its owner.
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
# Children, adopted with ownerReferences: the garbage collector deletes them with their parent.
# Deployments are also watched, so a child's change (readiness, drift) triggers a reconcile.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
# The model cache claim, for spec.modelCache with a size (patched to expand it).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
# A hub model's token (spec.model.hfTokenSecretRef), to fetch its config.json for sizing.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# The autoscaler scrapes each ready engine pod's /metrics.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# Events for decisions and errors (the handlers' own, and kopf's warnings).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{- define "kvpilot.clusterRules" -}}
# kopf follows the CRD (added, removed, new versions) to start and stop its watches.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
