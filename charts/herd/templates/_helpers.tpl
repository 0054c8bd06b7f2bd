{{/* The chart's name, truncated to a DNS label. */}}
{{- define "herd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name. The release name alone when it already contains the chart name,
so `helm install herd charts/herd` gives the Service herd-orchestrator that ModelDeployment status
endpoints name.
*/}}
{{- define "herd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's resource name: (dict "root" $ "component" "operator"). */}}
{{- define "herd.componentName" -}}
{{- printf "%s-%s" (include "herd.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of a component: (dict "root" $ "component" "operator"). */}}
{{- define "herd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "herd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Standard labels of a component: (dict "root" $ "component" "operator"). */}}
{{- define "herd.labels" -}}
{{ include "herd.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: herd
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* An image reference: (dict "root" $ "image" .Values.operator.image); the tag defaults to appVersion. */}}
{{- define "herd.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* A component's ServiceAccount name: (dict "root" $ "component" "operator"). */}}
{{- define "herd.serviceAccountName" -}}
{{- $account := (index .root.Values .component).serviceAccount }}
{{- if $account.create }}
{{- default (include "herd.componentName" .) $account.name }}
{{- else }}
{{- default "default" $account.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the workers' internal token under the key `token`. */}}
{{- define "herd.tokenSecretName" -}}
{{- default (include "herd.componentName" (dict "root" . "component" "internal-token")) .Values.internalToken.existingSecret }}
{{- end }}

{{/* The env entry that carries the internal token into a container. */}}
{{- define "herd.tokenEnv" -}}
- name: HERD_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "herd.tokenSecretName" . }}
      key: token
{{- end }}

{{/* The Redis URL the orchestrator shares state through, or nothing. */}}
{{- define "herd.redisUrl" -}}
{{- if and .Values.redis.enabled .Values.redis.externalUrl }}
{{- fail "redis.enabled and redis.externalUrl are exclusive: set one (an in-cluster Redis, or the URL of yours)" }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc:6379/0" (include "herd.componentName" (dict "root" . "component" "redis")) .Release.Namespace }}
{{- else }}
{{- .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* The namespaces watched when watch.allNamespaces is false, as a JSON list. */}}
{{- define "herd.watchNamespaces" -}}
{{- default (list .Release.Namespace) .Values.watch.namespaces | uniq | toJson }}
{{- end }}

{{/* The operator's scope: `--all-namespaces`, or `--namespace NS` for each watched namespace. */}}
{{- define "herd.operatorWatchArgs" -}}
{{- if .Values.watch.allNamespaces }}
- --all-namespaces
{{- else }}
{{- range include "herd.watchNamespaces" . | fromJsonArray }}
- --namespace
- {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The orchestrator's scope: every namespace by default, or the one `--namespace` it can watch. */}}
{{- define "herd.orchestratorWatchArgs" -}}
{{- if not .Values.watch.allNamespaces }}
{{- $namespaces := include "herd.watchNamespaces" . | fromJsonArray }}
{{- if gt (len $namespaces) 1 }}
{{- fail (printf "watch.namespaces lists %d namespaces but `herd orchestrator --kubernetes` watches one or all: list one, or set watch.allNamespaces=true" (len $namespaces)) }}
{{- end }}
- --namespace
- {{ first $namespaces }}
{{- end }}
{{- end }}

{{/*
Namespaces that get a copy of the internal-token Secret: the release's (the orchestrator reads it
there) and every watched one, because worker pods read the Secret from their own namespace.
*/}}
{{- define "herd.tokenNamespaces" -}}
{{- $namespaces := list .Release.Namespace }}
{{- if not .Values.watch.allNamespaces }}
{{- $namespaces = concat $namespaces (include "herd.watchNamespaces" . | fromJsonArray) | uniq }}
{{- end }}
{{- toJson $namespaces }}
{{- end }}

{{/* A pod's security context: (dict "root" $ "runAsUser" 999); runAsUser/runAsGroup/fsGroup override. */}}
{{- define "herd.podSecurityContext" -}}
{{- $context := deepCopy .root.Values.podSecurityContext }}
{{- with .runAsUser }}
{{- $_ := set $context "runAsUser" . }}
{{- $_ := set $context "runAsGroup" . }}
{{- $_ := set $context "fsGroup" . }}
{{- end }}
{{- toYaml $context }}
{{- end }}

{{/* Scheduling fields of a pod from a component's values (nodeSelector, tolerations, affinity). */}}
{{- define "herd.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* imagePullSecrets of every pod. */}}
{{- define "herd.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A pod's /tmp: Python and its libraries need a writable temp dir under a read-only root. */}}
{{- define "herd.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}
