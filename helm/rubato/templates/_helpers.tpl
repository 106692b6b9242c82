{{/* Names, labels and the rubato YAML shared by the templates. */}}

{{- define "rubato.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's base name; objects add "-inference", "-cache", ... (63-character limit). */}}
{{- define "rubato.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rubato.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: include "rubato.selectorLabels" (list . "inference") */}}
{{- define "rubato.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "rubato.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "rubato.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "rubato.chart" $root }}
{{ include "rubato.selectorLabels" . }}
app.kubernetes.io/part-of: rubato
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end -}}

{{- define "rubato.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "rubato.cacheServiceName" -}}
{{- printf "%s-cache" (include "rubato.fullname" .) -}}
{{- end -}}

{{/*
The rubato YAML (configs/default.yaml has every key): .Values.config with what the chart owns
laid over it: model.path, server (all interfaces, inference.port, /metrics served on that port
so the separate metrics_port is off, the drain time inference.shutdownGraceSeconds) and, in
disaggregated mode, the topology and the offloaded KV residency. Each inference rank resolves the
cache ranks' headless Service name and connects to one of the cache ranks ready at that moment.
*/}}
{{- define "rubato.config" -}}
{{- $owned := dict "model" (dict "path" .Values.model.path)
      "server" (dict "host" "0.0.0.0" "port" (int .Values.inference.port) "metrics_port" 0
        "shutdown_grace_s" (int .Values.inference.shutdownGraceSeconds)) -}}
{{- if eq .Values.mode "disaggregated" -}}
{{- $endpoint := printf "%s.%s.svc:%d" (include "rubato.cacheServiceName" .) .Release.Namespace (int .Values.cache.rpcPort) -}}
{{- $_ := set $owned "engine" (dict "kv_residency" "offloaded") -}}
{{- $_ := set $owned "topology" (dict "mode" "disaggregated" "transport" .Values.cache.transport "cache_endpoints" (list $endpoint)) -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.config) $owned) -}}
{{- end -}}

{{/* Refuses value combinations that would render pods that cannot start. */}}
{{- define "rubato.validate" -}}
{{- $engine := .Values.config.engine | default dict -}}
{{- if and (eq (toString $engine.backend) "cuda") (lt (int .Values.inference.gpus) 1) -}}
{{- fail "config.engine.backend cuda needs inference.gpus >= 1" -}}
{{- end -}}
{{- if lt (int .Values.inference.terminationGracePeriodSeconds) (add (int .Values.inference.shutdownGraceSeconds) 5) -}}
{{- fail "inference.terminationGracePeriodSeconds must be at least inference.shutdownGraceSeconds + 5: the pod is killed before rubato serve has ended the requests still running" -}}
{{- end -}}
{{- if eq .Values.mode "disaggregated" -}}
{{- if and (eq .Values.cache.transport "nccl") (or (lt (int .Values.inference.gpus) 1) (lt (int .Values.cache.gpus) 1)) -}}
{{- fail "cache.transport nccl moves the KV GPU to GPU: it needs inference.gpus >= 1 and cache.gpus >= 1" -}}
{{- end -}}
{{- if eq (toString $engine.kv_residency) "evicting" -}}
{{- fail "mode disaggregated keeps the KV on cache ranks (engine.kv_residency offloaded); config.engine.kv_residency evicting is a colocated setting" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* /dev/shm: UCX shared memory and NCCL use it; a container gets only 64 MiB without it. */}}
{{- define "rubato.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with . }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end -}}

{{/* Probe timings: include "rubato.probe" (list "http" .Values.inference.readinessProbe) */}}
{{- define "rubato.probe" -}}
httpGet:
  path: /health
  port: {{ index . 0 }}
{{ toYaml (index . 1) }}
{{- end -}}
