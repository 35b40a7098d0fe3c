{{/* flyte-binary's values (the subchart's key has a dash, so it needs index). */}}
{{- define "fuseforge.flyte" -}}
{{- index .Values "flyte-binary" | toJson -}}
{{- end }}

{{/* Labels of the umbrella chart's own resources. */}}
{{- define "fuseforge.labels" -}}
app.kubernetes.io/name: fuseforge
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}
