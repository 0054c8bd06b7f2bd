{{/*
What the operator may do in a watched namespace: reconcile ModelDeployments into Deployments and
Services, read worker pods for status, and post Events. No Secrets: worker pods name the token Secret
in a secretKeyRef that the kubelet resolves, and `create` on Secrets (which RBAC cannot limit by name)
would let the operator mint a token Secret for any ServiceAccount.
*/}}
{{- define "herd.operator.rules" -}}
- apiGroups: [herd.dev]
  resources: [modeldeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [herd.dev]
  resources: [modeldeployments/status]
  verbs: [get, patch]
- apiGroups: [herd.dev]
  resources: [modeldeployments/scale]
  verbs: [get, patch]
# Children carry blockOwnerDeletion: clusters with OwnerReferencesPermissionEnforcement require this.
- apiGroups: [herd.dev]
  resources: [modeldeployments/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, update, patch, delete]
# A pool whose replica spans several pods (podsPerReplica): its LeaderWorkerSet (the LWS controller
# must be installed for it to make pods).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
# spec.gateway.inferencePool: the InferencePool, and the endpoint picker's account, Role (pods and
# ModelDeployments, read only: rights the operator holds itself) and binding.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, update, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, update, delete]
{{- end }}

{{/*
Cluster-scoped reads of the operator: kopf follows CRD changes (it only warns without them). Serving
named namespaces, kopf also lists and watches namespaces to see which exist: refused, it retried the 403
nine times, about a minute, before its first reconcile (tests/e2e/test_cluster_operator_scoped.py).
*/}}
{{- define "herd.operator.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- if not .Values.watch.allNamespaces }}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end }}

{{/* The orchestrator only discovers: ModelDeployments (routing settings) and worker pods. */}}
{{- define "herd.orchestrator.rules" -}}
- apiGroups: [herd.dev]
  resources: [modeldeployments]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- end }}

{{/*
A component's RBAC: (dict "root" $ "component" "operator" "rules" LIST "clusterRules" LIST).
watch.allNamespaces: one ClusterRole with every rule. Otherwise a Role and RoleBinding in each
watched namespace, plus a ClusterRole for the cluster-scoped rules alone.
*/}}
{{- define "herd.rbac" -}}
{{- $root := .root }}
{{- $name := include "herd.componentName" . }}
{{- $labels := include "herd.labels" . }}
{{- $subject := dict "name" (include "herd.serviceAccountName" .) "namespace" $root.Release.Namespace }}
{{- if $root.Values.watch.allNamespaces }}
{{- include "herd.rbacPair" (dict "kind" "ClusterRole" "name" $name "labels" $labels "rules" (concat .rules .clusterRules) "subject" $subject) }}
{{- else }}
{{- range include "herd.watchNamespaces" $root | fromJsonArray }}
{{- include "herd.rbacPair" (dict "kind" "Role" "name" $name "namespace" . "labels" $labels "rules" $.rules "subject" $subject) }}
{{- end }}
{{- with .clusterRules }}
{{- include "herd.rbacPair" (dict "kind" "ClusterRole" "name" $name "labels" $labels "rules" . "subject" $subject) }}
{{- end }}
{{- end }}
{{- end }}

{{/* One (Cluster)Role and its (Cluster)RoleBinding, each as its own YAML document. */}}
{{- define "herd.rbacPair" }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ .kind }}
metadata:
  name: {{ .name }}
  {{- with .namespace }}
  namespace: {{ . }}
  {{- end }}
  labels:
    {{- .labels | nindent 4 }}
rules:
  {{- toYaml .rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ .kind }}Binding
metadata:
  name: {{ .name }}
  {{- with .namespace }}
  namespace: {{ . }}
  {{- end }}
  labels:
    {{- .labels | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: {{ .kind }}
  name: {{ .name }}
subjects:
  - kind: ServiceAccount
    name: {{ .subject.name }}
    namespace: {{ .subject.namespace }}
{{- end }}
