{{/* Labels every platform resource carries. */}}
{{- define "platform.labels" -}}
app.kubernetes.io/name: fuseforge
app.kubernetes.io/component: platform
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Namespace flytepropeller runs in. */}}
{{- define "platform.flyteNamespace" -}}
{{- default .Release.Namespace .Values.flyteNamespace -}}
{{- end }}

{{/*
The "<project>-<domain>" namespaces Flyte runs task pods in, as a JSON list of
{"name", "project", "domain"} (use: include "platform.taskNamespaces" . | fromJsonArray).
*/}}
{{- define "platform.taskNamespaces" -}}
{{- $namespaces := list -}}
{{- range $project := .Values.projects -}}
{{- range $domain := $.Values.domains -}}
{{- $ns := printf "%s-%s" $project $domain -}}
{{- if gt (len $ns) 63 -}}
{{- fail (printf "namespace %q (project %q + domain %q) is longer than 63 characters: shorten the project or domain name" $ns $project $domain) -}}
{{- end -}}
{{- $namespaces = append $namespaces (dict "name" $ns "project" $project "domain" $domain) -}}
{{- end -}}
{{- end -}}
{{- toJson $namespaces -}}
{{- end }}

{{/*
Namespaces that get the PodTemplate and ConfigMap: the task namespaces ("managed": the training
ServiceAccount and the ConfigMap exist there), plus flyteNamespace (the fallback Flyte consults)
unless it is one of them. Same JSON shape as platform.taskNamespaces, plus "managed".
*/}}
{{- define "platform.templateNamespaces" -}}
{{- $out := list -}}
{{- $names := list -}}
{{- range $ns := include "platform.taskNamespaces" . | fromJsonArray -}}
{{- $out = append $out (set $ns "managed" true) -}}
{{- $names = append $names $ns.name -}}
{{- end -}}
{{- $flyteNs := include "platform.flyteNamespace" . -}}
{{- if and .Values.gpuPodTemplate.installInFlyteNamespace (not (has $flyteNs $names)) -}}
{{- $out = append $out (dict "name" $flyteNs "project" (first .Values.projects) "domain" (first .Values.domains) "managed" false) -}}
{{- end -}}
{{- toJson $out -}}
{{- end }}

{{/*
The image of the PodTemplates' containers. Flyte replaces it with each task's own image, but
Kubernetes requires one; it always carries a tag, never the implicit :latest. With image.tag ""
(the content hash fuseforge_flyte computes at registration) the tag is a placeholder no node pulls.
*/}}
{{- define "platform.image" -}}
{{- printf "%s/%s:%s" .Values.image.registry .Values.image.name (.Values.image.tag | default "set-by-flyte-task") -}}
{{- end }}

{{/* Pod Security admission labels of a managed namespace. */}}
{{- define "platform.podSecurityLabels" -}}
{{- $ps := .Values.namespaces.podSecurity -}}
{{- $version := $ps.version | default "latest" -}}
{{- range $mode := list "enforce" "warn" "audit" }}
{{- with get $ps $mode }}
pod-security.kubernetes.io/{{ $mode }}: {{ . }}
pod-security.kubernetes.io/{{ $mode }}-version: {{ $version }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The Secret holding the checkpoint key in each task namespace: checkpointKey.existingSecret, or the one
this chart creates (checkpointKey.create). values.schema.json refuses both and neither; this check
also holds when schema validation is skipped. The file name inside checkpointKey.mountPath is fixed
("key"), whatever the Secret's key is called.
*/}}
{{- define "platform.checkpointKeySecret" -}}
{{- $ck := .Values.checkpointKey -}}
{{- if and $ck.create $ck.existingSecret -}}
{{- fail (printf "checkpointKey: create is true and existingSecret is %q: either let the chart create the key (create: true, existingSecret: \"\") or bring your own Secret (create: false, existingSecret: <name>)" $ck.existingSecret) -}}
{{- else if and (not $ck.create) (not $ck.existingSecret) -}}
{{- fail "checkpointKey: create is false and no existingSecret is named: training pods need a checkpoint key (checkpoints on object stores are refused without one). Set create: true, or existingSecret to a Secret you create in each task namespace" -}}
{{- end -}}
{{- $ck.existingSecret | default "fuseforge-checkpoint-key" -}}
{{- end }}

{{- define "platform.checkpointKeyFile" -}}
{{- printf "%s/key" (trimSuffix "/" .Values.checkpointKey.mountPath) -}}
{{- end }}
