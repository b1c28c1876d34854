{{/*
Names, labels and the few values derived from several others. The SLOTKEEPER_* variables themselves
are all in env.yaml.
*/}}

{{- define "slotkeeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; 40 characters leave room for "-gateway-env" and the StatefulSet's
revision-hash label (pod name + 11 characters must fit in 63). */}}
{{- define "slotkeeper.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "slotkeeper.gateway.name" -}}{{ include "slotkeeper.fullname" . }}-gateway{{- end }}
{{- define "slotkeeper.node.name" -}}{{ include "slotkeeper.fullname" . }}-node{{- end }}
{{- define "slotkeeper.redis.name" -}}{{ include "slotkeeper.fullname" . }}-redis{{- end }}
{{- define "slotkeeper.secret.name" -}}{{ include "slotkeeper.fullname" . }}-secrets{{- end }}

{{- define "slotkeeper.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "slotkeeper.labels" -}}
helm.sh/chart: {{ include "slotkeeper.chart" . }}
app.kubernetes.io/name: {{ include "slotkeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: include with (list $ "gateway"). */}}
{{- define "slotkeeper.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "slotkeeper.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "slotkeeper.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{- define "slotkeeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "slotkeeper.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* One URL per node pod, through the headless Service: the gateway's --node list. */}}
{{- define "slotkeeper.nodeUrls" -}}
{{- $node := include "slotkeeper.node.name" . }}
{{- $urls := list }}
{{- range $i := until (int .Values.node.replicas) }}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc.%s:%d" $node $i $node $.Release.Namespace $.Values.clusterDomain (int $.Values.node.port)) }}
{{- end }}
{{- join "," $urls }}
{{- end }}

{{/* Where the Redis URL comes from: "secretName/key". */}}
{{- define "slotkeeper.redisUrlRef" -}}
{{- if .Values.redis.existingSecret }}
{{- printf "%s/%s" .Values.redis.existingSecret .Values.redis.existingSecretKey }}
{{- else if or .Values.redis.url .Values.redis.enabled }}
{{- printf "%s/redis-url" (include "slotkeeper.secret.name" .) }}
{{- else }}
{{- fail "Slotkeeper needs a shared Redis: set redis.url, redis.existingSecret, or redis.enabled=true (demo only)" }}
{{- end }}
{{- end }}

{{/* The Redis URL the chart stores itself (an explicit URL wins over the in-chart Redis). */}}
{{- define "slotkeeper.redisUrl" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc.%s:6379/0" (include "slotkeeper.redis.name" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}
{{- end }}

{{/* S3 credentials: "secretName" when there are any, "" for boto3's own chain. */}}
{{- define "slotkeeper.s3SecretName" -}}
{{- if .Values.s3.existingSecret }}
{{- .Values.s3.existingSecret }}
{{- else if and .Values.s3.accessKey .Values.s3.secretKey }}
{{- include "slotkeeper.secret.name" . }}
{{- else if or .Values.s3.accessKey .Values.s3.secretKey }}
{{- fail "s3.accessKey and s3.secretKey go together (or leave both empty for boto3's credential chain)" }}
{{- end }}
{{- end }}

{{- define "slotkeeper.s3AccessKeyKey" -}}
{{- if .Values.s3.existingSecret }}{{ .Values.s3.accessKeyKey }}{{ else }}s3-access-key{{ end }}
{{- end }}
{{- define "slotkeeper.s3SecretKeyKey" -}}
{{- if .Values.s3.existingSecret }}{{ .Values.s3.secretKeyKey }}{{ else }}s3-secret-key{{ end }}
{{- end }}

{{/* The tenants file: "secretName/key", or "" for none (one open tenant). */}}
{{- define "slotkeeper.tenantsRef" -}}
{{- if .Values.tenants.existingSecret }}
{{- printf "%s/%s" .Values.tenants.existingSecret .Values.tenants.existingSecretKey }}
{{- else if .Values.tenants.toml }}
{{- printf "%s/tenants.toml" (include "slotkeeper.secret.name" .) }}
{{- end }}
{{- end }}

{{- define "slotkeeper.tenantsDir" -}}/etc/slotkeeper/tenants{{- end }}

{{/* The node's grace period: at least drain + engine stop + 15 s of server shutdown. */}}
{{- define "slotkeeper.node.terminationGrace" -}}
{{- $floor := add (ceil .Values.node.drainGraceS | int) (ceil .Values.node.engineStopGraceS | int) 15 }}
{{- $grace := .Values.node.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $grace }}
{{- add $floor 15 }}
{{- else if lt (int $grace) (int $floor) }}
{{- fail (printf "node.terminationGracePeriodSeconds (%d) must be at least drainGraceS + engineStopGraceS + 15 = %d, or the kubelet kills the node in the middle of its drain" (int $grace) (int $floor)) }}
{{- else }}
{{- int $grace }}
{{- end }}
{{- end }}

{{/* Model paths, absolute: relative ones live under modelVolume.mountPath. */}}
{{- define "slotkeeper.modelPaths" -}}
{{- $paths := list }}
{{- range .Values.node.models }}
{{- if not .path }}{{ fail "every node.models entry needs a path" }}{{ end }}
{{- $paths = append $paths (ternary .path (printf "%s/%s" (trimSuffix "/" $.Values.node.modelVolume.mountPath) .path) (hasPrefix "/" .path)) }}
{{- end }}
{{- if not $paths }}{{ fail "node.models needs at least one model" }}{{ end }}
{{- join "," $paths }}
{{- end }}

{{/* Aliases by position; when any is set every model gets one (the default is what the node would
pick itself: the file name without .gguf), since the node matches them to models by position. */}}
{{- define "slotkeeper.modelAliases" -}}
{{- $any := false }}
{{- range .Values.node.models }}{{ if .alias }}{{ $any = true }}{{ end }}{{ end }}
{{- if $any }}
{{- $aliases := list }}
{{- range .Values.node.models }}
{{- $aliases = append $aliases (default (base .path | trimSuffix ".gguf") .alias) }}
{{- end }}
{{- join "," $aliases }}
{{- end }}
{{- end }}

{{/* engineArgs as one comma-separated variable: an argument with a comma cannot be carried. */}}
{{- define "slotkeeper.engineArgs" -}}
{{- range .Values.node.engineArgs }}
{{- if contains "," (toString .) }}{{ fail (printf "node.engineArgs: %q contains a comma, which the comma-separated engine argument variable cannot carry" (toString .)) }}{{ end }}
{{- end }}
{{- join "," .Values.node.engineArgs }}
{{- end }}

{{/* Egress both components need once it is restricted: DNS, the in-chart Redis, and the peers the
operator names for an external Redis and S3 (`networkPolicy.egressTo`: NetworkPolicyEgressRule items). */}}
{{- define "slotkeeper.networkPolicy.egress" -}}
- ports:
    - {protocol: UDP, port: 53}
    - {protocol: TCP, port: 53}
{{- if .Values.redis.enabled }}
- to:
    - podSelector:
        matchLabels:
          {{- include "slotkeeper.selectorLabels" (list . "redis") | nindent 10 }}
  ports:
    - {protocol: TCP, port: 6379}
{{- end }}
{{- with .Values.networkPolicy.egressTo }}
{{ toYaml . }}
{{- end }}
{{- end }}
