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
