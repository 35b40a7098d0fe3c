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

{{/* flyte-binary's fullname (its Deployment, ServiceAccount and the names derived from it), as that chart makes it. */}}
{{- define "fuseforge.flyteFullname" -}}
{{- $flyte := include "fuseforge.flyte" . | fromJson -}}
{{- if $flyte.fullnameOverride -}}
{{- $flyte.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := $flyte.nameOverride | default "flyte-binary" -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The ServiceAccount Flyte's pod runs as (flyte-binary.serviceAccount), as that chart names it. */}}
{{- define "fuseforge.flyteServiceAccount" -}}
{{- $flyte := include "fuseforge.flyte" . | fromJson -}}
{{- $sa := $flyte.serviceAccount | default dict -}}
{{- if or (not (hasKey $sa "create")) $sa.create -}}
{{- $sa.name | default (include "fuseforge.flyteFullname" .) -}}
{{- else -}}
{{- $sa.name | default "default" -}}
{{- end -}}
{{- end }}
