{{/* Helm's standard labels, on every object's metadata (not on selectors or pod templates). */}}
{{- define "mpsagent.standardLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{- define "mpsagent.image" -}}
{{- $repository := required "image.repository: the image of the agent (packaging/container) is required" .Values.image.repository -}}
{{- printf "%s:%s" $repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end }}

{{/* The config file's text: a string as it is, a map through toYaml; it must be the v1 format. */}}
{{- define "mpsagent.configText" -}}
{{- $config := .Values.config -}}
{{- if not $config -}}
{{- fail "config: the agent's config (the NVIDIA device plugin's v1 format, docs/configuration.md) is required: a map, or a string with --set-file config=FILE" -}}
{{- end -}}
{{- $text := "" -}}
{{- if kindIs "string" $config -}}
{{- $text = $config -}}
{{- else if kindIs "map" $config -}}
{{- $text = toYaml $config -}}
{{- else -}}
{{- fail (printf "config: expected a map or a string (the file's text), got a %s" (kindOf $config)) -}}
{{- end -}}
{{- $parsed := fromYaml $text -}}
{{- if hasKey $parsed "Error" -}}
{{- fail (printf "config: not YAML: %s" $parsed.Error) -}}
{{- end -}}
{{- $version := toString ($parsed.version | default "") -}}
{{- if ne $version "v1" -}}
{{- fail (printf "config.version: expected v1 (the NVIDIA device plugin's config format), got %s" (ternary "nothing" (quote $version) (eq $version ""))) -}}
{{- end -}}
{{- $text -}}
{{- end }}

{{/* Like kustomize's configMapGenerator: the name carries a hash of the content, so a change rolls the agent out. */}}
{{- define "mpsagent.configMapName" -}}
{{- printf "mpsagent-config-%s" (include "mpsagent.configText" . | sha256sum | trunc 10) -}}
{{- end }}

{{- define "mpsagent.metricsPort" -}}
{{- $port := .Values.metricsPort | int -}}
{{- if or (lt $port 1) (gt $port 65535) (ne (toString $port) (toString .Values.metricsPort)) -}}
{{- fail (printf "metricsPort: expected a port number (1..65535), got %v" .Values.metricsPort) -}}
{{- end -}}
{{- $port -}}
{{- end }}

{{/* A probe from values ("probe"), its httpGet.port the metrics port ("port") unless the values set one. */}}
{{- define "mpsagent.probe" -}}
{{- $probe := deepCopy .probe -}}
{{- if and (kindIs "map" $probe.httpGet) (not (hasKey $probe.httpGet "port")) -}}
{{- $_ := set $probe.httpGet "port" .port -}}
{{- end -}}
{{- toYaml $probe -}}
{{- end }}

{{/* The pod spec fields both DaemonSets share: where they run, and how. */}}
{{- define "mpsagent.podPlacement" -}}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if not (kindIs "bool" .Values.hostNetwork) }}
{{- fail (printf "hostNetwork: expected true or false, got %v" .Values.hostNetwork) }}
{{- else if .Values.hostNetwork }}
hostNetwork: true
{{- end }}
{{- end }}

{{/* "true" when dra.enabled, else empty; dra's switches must be true or false. */}}
{{- define "mpsagent.draEnabled" -}}
{{- $dra := .Values.dra -}}
{{- if not (kindIs "map" $dra) -}}
{{- fail (printf "dra: expected a map (enabled, deviceClasses, extendedResourceClass), got %v" $dra) -}}
{{- end -}}
{{- range $name := list "enabled" "deviceClasses" "extendedResourceClass" -}}
{{- if not (kindIs "bool" (index $dra $name)) -}}
{{- fail (printf "dra.%s: expected true or false, got %v" $name (index $dra $name)) -}}
{{- end -}}
{{- end -}}
{{- if $dra.enabled }}true{{ end -}}
{{- end }}
