{{/* Chart name, truncated to the 63 characters Kubernetes allows in a label value. */}}
{{- define "meshjob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's resources: "<release>-<chart>", or the release name when it already holds the chart name. */}}
{{- define "meshjob.fullname" -}}
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

{{- define "meshjob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "meshjob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "meshjob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "meshjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "meshjob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "meshjob.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{- define "meshjob.trainerImage" -}}
{{- printf "%s:%s" .Values.operator.trainerImage.repository (default .Chart.AppVersion .Values.operator.trainerImage.tag) }}
{{- end }}

{{/* Labels of Prometheus Operator objects: the chart's, the `release` label Prometheus selects by, extras. */}}
{{- define "meshjob.monitoringLabels" -}}
{{ include "meshjob.labels" .root }}
release: {{ .root.Values.monitoring.release | quote }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The webhook's serving Secret: certSecret, else cert-manager's Certificate's; empty: self-signed. */}}
{{- define "meshjob.webhookSecret" -}}
{{- if .Values.operator.webhook.certSecret }}
{{- .Values.operator.webhook.certSecret }}
{{- else if .Values.operator.webhook.certManager.enabled }}
{{- printf "%s-webhook-tls" (include "meshjob.fullname" .) }}
{{- end }}
{{- end }}

{{/* The operator's rules in a namespace whose TrainingJobs it serves: in its ClusterRole when it serves every
namespace, else in a Role of each of operator.namespaces. */}}
{{- define "meshjob.jobNamespaceRules" -}}
# The custom resource: kopf watches it and patches finalizers and progress annotations; the
# reconciler reads it, writes status, and deletes finished jobs after ttlSecondsAfterFinished.
- apiGroups: [meshjob.io]
  resources: [trainingjobs]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [meshjob.io]
  resources: [trainingjobs/status]
  verbs: [patch]
# Children: one pod per host (deleted for gang restarts), watched for failures; patched only to mark a
# failed Kueue pod group not retriable (annotation kueue.x-k8s.io/retriable-in-group).
- apiGroups: [""]
  resources: [pods]
  verbs: [watch, create, delete, patch]
# The plan in a ConfigMap (re-read after an operator restart, refreshed on a new placement).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
# The headless Service for rendezvous; owner references let the garbage collector delete it.
- apiGroups: [""]
  resources: [services]
  verbs: [create]
# Gang scheduling (spec.scheduling.gang): a scheduler-plugins PodGroup per job.
- apiGroups: [scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [create]
# Events on TrainingJobs (kopf's and the operator's Warning events).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
