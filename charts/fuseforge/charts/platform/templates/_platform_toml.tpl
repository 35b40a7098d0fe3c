{{/*
platform.toml as the tasks see it (the [image], [cluster], [flyte], [elastic], [training],
[checkpoint] tables of fuseforge_flyte.config): platformConfig.content verbatim when given,
otherwise platformConfig.settings combined with what this chart knows about the cluster.
Facts of this install (image, the GPU template) must agree with the resources the chart creates,
so settings may not set them (an error names the value to change instead); defaults (the
namespace's Flyte project and domain, workers per pod) only fill keys settings leave out.
Input: dict "root" $ "namespace" <target>.
*/}}
{{- define "platform.platformToml" -}}
{{- $target := .namespace -}}
{{- with .root -}}
{{- if .Values.platformConfig.content -}}
{{- .Values.platformConfig.content -}}
{{- else -}}
{{- $tpl := .Values.gpuPodTemplate -}}
{{- $settings := deepCopy (.Values.platformConfig.settings | default dict) -}}
{{- $tolerations := list -}}
{{- range $t := $tpl.tolerations -}}
{{- $toleration := pick $t "key" "operator" "value" "effect" -}}
{{- if hasKey $t "tolerationSeconds" -}}{{- $_ := set $toleration "toleration_seconds" $t.tolerationSeconds -}}{{- end -}}
{{- $tolerations = append $tolerations $toleration -}}
{{- end -}}
{{- $cluster := dict
  "gpus" (int $tpl.gpus)
  "shared_memory" ""
  "node_selector" (deepCopy ($tpl.nodeSelector | default dict))
  "tolerations" $tolerations
  "pod_template_name" $tpl.name -}}
{{- $requests := $tpl.resources.requests | default dict -}}
{{- if hasKey $requests "cpu" -}}{{- $_ := set $cluster "cpu" (toString $requests.cpu) -}}{{- end -}}
{{- if hasKey $requests "memory" -}}{{- $_ := set $cluster "memory" (toString $requests.memory) -}}{{- end -}}
{{- $facts := dict
  "image" (dict "registry" .Values.image.registry "name" .Values.image.name "tag" .Values.image.tag)
  "cluster" $cluster -}}
{{- $sources := dict
  "image" (dict "registry" "image.registry" "name" "image.name" "tag" "image.tag")
  "cluster" (dict "gpus" "gpuPodTemplate.gpus" "shared_memory" "gpuPodTemplate.shmSize"
    "node_selector" "gpuPodTemplate.nodeSelector" "tolerations" "gpuPodTemplate.tolerations"
    "pod_template_name" "gpuPodTemplate.name" "cpu" "gpuPodTemplate.resources.requests.cpu"
    "memory" "gpuPodTemplate.resources.requests.memory") -}}
{{- range $section, $table := $facts -}}
{{- range $key, $_ := $table -}}
{{- if hasKey (get $settings $section | default dict) $key -}}
{{- fail (printf "platformConfig.settings.%s.%s comes from %s in this chart: set it there, not in settings" $section $key (get (get $sources $section) $key)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* [elastic].nproc_per_node is left out unless settings give it: fuseforge_flyte then runs one worker per GPU. */ -}}
{{- $defaults := dict "flyte" (dict "project" $target.project "domain" $target.domain) -}}
{{- $config := mergeOverwrite (mergeOverwrite $defaults $settings) $facts -}}
{{- $nproc := dig "elastic" "nproc_per_node" 0 $config | int -}}
{{- if and (gt (int $tpl.gpus) 0) (gt $nproc (int $tpl.gpus)) -}}
{{- fail (printf "platformConfig.settings.elastic.nproc_per_node (%d) must be <= gpuPodTemplate.gpus (%d): each worker process drives one GPU" $nproc (int $tpl.gpus)) -}}
{{- end -}}
# platform.toml of the fuseforge cluster, rendered by the fuseforge Helm chart (release {{ .Release.Name }}).
# Register workflows for this cluster with it:
#   kubectl -n {{ $target.name }} get configmap {{ .Values.platformConfig.configMapName }} -o jsonpath='{.data.platform\.toml}' > cluster.toml
#   export FUSEFORGE_CONFIG=$PWD/cluster.toml
# [cluster].shared_memory is empty because PodTemplate "{{ $tpl.name }}" already mounts a {{ $tpl.shmSize }} /dev/shm
# (a second /dev/shm mount would make the pods invalid).
{{- include "platform.toml.table" (dict "table" $config "path" "") }}
{{ end -}}
{{- end -}}
{{- end }}
