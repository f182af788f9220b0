{{/* Names and labels. */}}
{{- define "switchyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "switchyard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "switchyard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "switchyard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "switchyard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "switchyard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "switchyard.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces discovery watches, as a JSON list ([] = all namespaces). */}}
{{- define "switchyard.watchNamespaces" -}}
{{- if .Values.discovery.allNamespaces -}}
[]
{{- else if .Values.discovery.namespaces -}}
{{- toJson .Values.discovery.namespaces -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* The gateway's config file. */}}
{{- define "switchyard.config" -}}
listen:
  host: 0.0.0.0
  port: {{ .Values.containerPort | int }}
server:
  shutdown_grace_s: {{ .Values.drain.graceSeconds }}
  drain_delay_s: {{ .Values.drain.delaySeconds }}
  log_format: {{ .Values.server.logFormat }}
  log_level: {{ .Values.server.logLevel }}
  max_body_bytes: {{ .Values.server.maxBodyBytes | int }}
kubernetes:
  enabled: {{ .Values.discovery.enabled }}
  kubeconfig: null
  namespaces: {{ include "switchyard.watchNamespaces" . }}
  label_selector: {{ .Values.discovery.labelSelector | quote }}
  resync_interval_s: {{ .Values.discovery.resyncIntervalSeconds }}
  {{- with .Values.discovery.models }}
  models:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- with .Values.config }}
{{ toYaml . }}
{{- end }}
{{- end -}}
