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

{{/* ServiceAccount of trainer pods (empty: none configured, the namespace's default is used). */}}
{{- define "meshjob.trainerServiceAccountName" -}}
{{- if .Values.trainer.serviceAccount.create }}
{{- default (printf "%s-trainer" (include "meshjob.fullname" .) | trunc 63 | trimSuffix "-") .Values.trainer.serviceAccount.name }}
{{- else }}
{{- .Values.trainer.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Namespaces where trainer pods run, as a JSON list: trainer.namespaces, else the operator's, else the release's. */}}
{{- define "meshjob.trainerNamespaces" -}}
{{- if .Values.trainer.namespaces }}
{{- toJson .Values.trainer.namespaces }}
{{- else if .Values.operator.namespaces }}
{{- toJson .Values.operator.namespaces }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}
