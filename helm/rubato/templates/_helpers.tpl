{{/* Names, labels and the rubato YAML shared by the templates. */}}

{{- define "rubato.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's base name; objects add "-inference", "-cache", "-cache-token", ... A StatefulSet's
name must leave room for its pods' controller-revision-hash label (name + "-" + 10 characters
<= 63): "<base>-cache" <= 52, so the base is at most 46 characters, a longer one cut to 37 and
given 8 hex digits of its hash (two long release names sharing a prefix still differ).
*/}}
{{- define "rubato.fullname" -}}
{{- $full := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $full = .Values.fullnameOverride -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- $full = .Release.Name -}}
{{- else -}}
{{- $full = printf "%s-%s" .Release.Name $name -}}
{{- end -}}
{{- end -}}
{{- if gt (len $full) 46 -}}
{{- printf "%s-%s" ($full | trunc 37 | trimSuffix "-") ($full | sha256sum | trunc 8) -}}
{{- else -}}
{{- $full | trimSuffix "-" -}}
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
so the separate metrics_port is off, the drain time inference.shutdownGraceSeconds, the metric
names metrics.names) and, in
disaggregated mode, the topology and the offloaded KV residency. Over UCX every inference rank
lists every cache replica by its stable name (<pod>.<service>) and places its requests on them by
free budget; those not up yet are connected in the background. Over NCCL (one device peer per
inference rank) it lists the headless Service name, which resolves to one cache rank ready then.
*/}}
{{- define "rubato.config" -}}
{{- $owned := dict "model" (dict "path" .Values.model.path)
      "server" (dict "host" "0.0.0.0" "port" (int .Values.inference.port) "metrics_port" 0
        "shutdown_grace_s" (int .Values.inference.shutdownGraceSeconds)
        "metrics_names" (.Values.metrics.names | default "rubato")) -}}
{{- if eq .Values.mode "disaggregated" -}}
{{- $service := include "rubato.cacheServiceName" . -}}
{{- $endpoints := list (printf "%s.%s.svc:%d" $service .Release.Namespace (int .Values.cache.rpcPort)) -}}
{{- if eq (toString .Values.cache.transport) "ucx" -}}
{{- $endpoints = list -}}
{{- range $i := until (int .Values.cache.replicas) -}}
{{- $endpoints = append $endpoints (printf "%s-%d.%s.%s.svc:%d" $service $i $service $.Release.Namespace (int $.Values.cache.rpcPort)) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $owned "engine" (dict "kv_residency" "offloaded") -}}
{{- $_ := set $owned "topology" (dict "mode" "disaggregated" "transport" .Values.cache.transport "cache_endpoints" $endpoints) -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.config) $owned) -}}
{{- end -}}

{{/* Refuses value combinations that would render pods that cannot start. */}}
{{- define "rubato.validate" -}}
{{- if and (eq .Values.mode "disaggregated") (lt (int .Values.cache.replicas) 1) -}}
{{- fail "mode disaggregated needs cache.replicas >= 1: the inference ranks' KV lives on the cache ranks" -}}
{{- end -}}
{{- $engine := .Values.config.engine | default dict -}}
{{- if and (eq (toString $engine.backend) "cuda") (lt (int .Values.inference.gpus) 1) -}}
{{- fail "config.engine.backend cuda needs inference.gpus >= 1" -}}
{{- end -}}
{{- $grace := int .Values.inference.terminationGracePeriodSeconds -}}
{{- if and (gt $grace 0) (lt $grace (int (include "rubato.inferenceGracePeriod" .))) -}}
{{- fail "inference.terminationGracePeriodSeconds must be at least inference.preStopSleepSeconds + inference.shutdownGraceSeconds + 5 (0: that sum): the pod is killed before rubato serve has ended the requests still running" -}}
{{- end -}}
{{- /* The residencies each policy supports (its PolicyTraits, inference_rank/policies/), with
       rubato's own refusal; tests/deploy/check compares both with `rubato serve --check`. */ -}}
{{- $residencies := dict "dense" (list "local" "offloaded") "streaming_llm" (list "local")
      "sfi" (list "local") "oracle_topk" (list "local" "offloaded") "kascade" (list "local")
      "longflow" (list "evicting") "asyncspade" (list "offloaded") "synckv" (list "split_by_head") -}}
{{- $policy := toString ((.Values.config.policy | default dict).name | default "dense") -}}
{{- $residency := toString ($engine.kv_residency | default "") -}}
{{- /* auto (rubato's default): the policy's own residency, which it always supports. */ -}}
{{- if eq $residency "auto" -}}{{- $residency = "" -}}{{- end -}}
{{- if eq .Values.mode "disaggregated" -}}{{- $residency = "offloaded" -}}{{- end -}}
{{- if and $residency (hasKey $residencies $policy) -}}
{{- $supported := get $residencies $policy -}}
{{- if not (has $residency $supported) -}}
{{- fail (printf "policy '%s' does not support %s KV (supported: %s)" $policy $residency (join ", " $supported)) -}}
{{- end -}}
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

{{/* The inference pods' grace period: preStop sleep + rubato's drain + 5 s to write its last errors. */}}
{{- define "rubato.inferenceGracePeriod" -}}
{{- add (int .Values.inference.preStopSleepSeconds) (int .Values.inference.shutdownGraceSeconds) 5 -}}
{{- end -}}

{{- define "rubato.cacheTokenSecret" -}}
{{- .Values.cache.token.existingSecret | default (printf "%s-cache-token" (include "rubato.fullname" .)) -}}
{{- end -}}

{{/*
The cache RPC token (disaggregated mode): the Secret mounted read-only in every rank's pod and
RUBATO_CACHE_TOKEN_FILE naming it (transport/rpc/rpc_auth.h), for the container's env and volumes.
*/}}
{{- define "rubato.cacheTokenEnv" -}}
- name: RUBATO_CACHE_TOKEN_FILE
  value: {{ printf "/etc/rubato-token/%s" .Values.cache.token.key | quote }}
{{- end -}}
{{- define "rubato.cacheTokenMount" -}}
- name: cache-token
  mountPath: /etc/rubato-token
  readOnly: true
{{- end -}}
{{- define "rubato.cacheTokenVolume" -}}
- name: cache-token
  secret:
    secretName: {{ include "rubato.cacheTokenSecret" . }}
    items:
      - key: {{ .Values.cache.token.key }}
        path: {{ .Values.cache.token.key }}
{{- end -}}

{{/* A pod's scheduling keys, each only when set: include "rubato.podScheduling" $pod */}}
{{- define "rubato.podScheduling" -}}
{{- range $key := list "priorityClassName" "runtimeClassName" "schedulerName" -}}
{{- with get $ $key }}
{{ $key }}: {{ . }}
{{- end -}}
{{- end -}}
{{- range $key := list "nodeSelector" "tolerations" "affinity" "topologySpreadConstraints" -}}
{{- with get $ $key }}
{{ $key }}:
  {{- toYaml . | nindent 2 }}
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
