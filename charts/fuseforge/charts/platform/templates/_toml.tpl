{{/*
A small TOML writer, so platform.toml can be given as YAML values.
Input: dict "table" MAP "path" "dotted.header" ("" at the top). Output: the table's plain keys, then
each sub-table under its [header], then each list of tables as [[header]] blocks. Strings go through
toJson, whose escapes (\" \\ \n \uXXXX) are all valid in TOML basic strings; null values are left
out (TOML has no null).
*/}}
{{- define "platform.toml.table" -}}
{{- $table := .table -}}
{{- $path := .path -}}
{{- $sorted := keys $table | sortAlpha -}}
{{- range $key := $sorted -}}
{{- $value := get $table $key -}}
{{- if not (or (kindIs "map" $value) (kindIs "invalid" $value) (eq (include "platform.toml.isTableList" $value) "true")) }}
{{ include "platform.toml.key" $key }} = {{ include "platform.toml.value" (dict "value" $value "key" $key) }}
{{- end -}}
{{- end -}}
{{- range $key := $sorted -}}
{{- $value := get $table $key -}}
{{- $header := include "platform.toml.header" (dict "path" $path "key" $key) -}}
{{- if kindIs "map" $value }}

[{{ $header }}]
{{- include "platform.toml.table" (dict "table" $value "path" $header) -}}
{{- else if eq (include "platform.toml.isTableList" $value) "true" -}}
{{- range $item := $value }}

[[{{ $header }}]]
{{- include "platform.toml.table" (dict "table" $item "path" $header) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* "true" for a non-empty list whose items are all tables (written as [[header]] blocks). */}}
{{- define "platform.toml.isTableList" -}}
{{- $tables := and (kindIs "slice" .) (gt (len .) 0) -}}
{{- if $tables -}}
{{- range $item := . -}}
{{- if not (kindIs "map" $item) -}}{{- $tables = false -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- $tables -}}
{{- end }}

{{- define "platform.toml.header" -}}
{{- $key := include "platform.toml.key" .key -}}
{{- if .path -}}{{ .path }}.{{ $key }}{{- else -}}{{ $key }}{{- end -}}
{{- end }}

{{- define "platform.toml.key" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end }}

{{- define "platform.toml.value" -}}
{{- $value := .value -}}
{{- if kindIs "slice" $value -}}
{{- range $item := $value -}}
{{- if or (kindIs "map" $item) (kindIs "invalid" $item) -}}
{{- fail (printf "platformConfig.settings: key %q mixes tables or nulls with other values in a list; platform.toml lists hold either only tables or only strings, numbers and booleans" $.key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $value -}}
{{- end }}
