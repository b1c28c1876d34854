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

{{/* The Redis topology (redis.mode): standalone (the in-chart pod), external, cluster or sentinel;
unset, standalone with redis.enabled and external otherwise. */}}
{{- define "slotkeeper.redisMode" -}}
{{- .Values.redis.mode | default (ternary "standalone" "external" (and .Values.redis.enabled (not .Values.redis.url) (not .Values.redis.existingSecret))) }}
{{- end }}

{{/* Where the Redis URL comes from: "secretName/key". */}}
{{- define "slotkeeper.redisUrlRef" -}}
{{- $mode := include "slotkeeper.redisMode" . }}
{{- if and (eq $mode "external") .Values.redis.existingSecret }}
{{- printf "%s/%s" .Values.redis.existingSecret .Values.redis.existingSecretKey }}
{{- else if include "slotkeeper.redisUrl" . }}
{{- printf "%s/redis-url" (include "slotkeeper.secret.name" .) }}
{{- else }}
{{- fail "Slotkeeper needs a shared Redis: set redis.url or redis.existingSecret (redis.mode external), redis.cluster.nodes (cluster), redis.sentinel.nodes (sentinel), or redis.mode=standalone (demo only)" }}
{{- end }}
{{- end }}

{{/* The Redis URL the chart stores itself, by redis.mode (docs/operations.md gives the forms). */}}
{{- define "slotkeeper.redisUrl" -}}
{{- $r := .Values.redis }}
{{- $mode := include "slotkeeper.redisMode" . }}
{{- $auth := ternary (printf ":%s@" (urlquery $r.password)) "" (ne $r.password "") }}
{{- if eq $mode "standalone" }}
{{- printf "redis://%s.%s.svc.%s:6379/0" (include "slotkeeper.redis.name" .) .Release.Namespace .Values.clusterDomain }}
{{- else if eq $mode "cluster" }}
{{- with $r.cluster.nodes }}{{ printf "%s-cluster://%s%s" (ternary "rediss" "redis" $r.tls) $auth (join "," .) }}{{ end }}
{{- else if eq $mode "sentinel" }}
{{- with $r.sentinel.nodes }}
{{- $query := ternary (printf "?sentinel_password=%s" (urlquery $r.sentinel.password)) "" (ne $r.sentinel.password "") }}
{{- printf "%s-sentinel://%s%s/%s/%d%s" (ternary "rediss" "redis" $r.tls) $auth (join "," .) $r.sentinel.masterName (int $r.sentinel.db) $query }}
{{- end }}
{{- else }}
{{- $r.url }}
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
{{- $mount := trimSuffix "/" $.Values.node.modelVolume.mountPath }}
{{- if and (hasPrefix "/" .path) (not (hasPrefix (printf "%s/" $mount) .path)) }}
{{- fail (printf "node.models: %s is outside node.modelVolume.mountPath (%s), where the models volume is mounted: give a path relative to it" .path $mount) }}
{{- end }}
{{- $paths = append $paths (ternary .path (printf "%s/%s" $mount .path) (hasPrefix "/" .path)) }}
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

{{/* Each model's engine role, comma-separated; "" when none is set (every engine mixed). */}}
{{- define "slotkeeper.modelRoles" -}}
{{- $any := false }}
{{- range .Values.node.models }}{{ if .role }}{{ $any = true }}{{ end }}{{ end }}
{{- if $any }}
{{- $roles := list }}
{{- range .Values.node.models }}
{{- $roles = append $roles (default "mixed" .role) }}
{{- end }}
{{- join "," $roles }}
{{- end }}
{{- end }}

{{/* engineArgs as one comma-separated variable: an argument with a comma cannot be carried. */}}
{{- define "slotkeeper.engineArgs" -}}
{{- range .Values.node.engineArgs }}
{{- if contains "," (toString .) }}{{ fail (printf "node.engineArgs: %q contains a comma, which the comma-separated engine argument variable cannot carry" (toString .)) }}{{ end }}
{{- end }}
{{- $stored := list "--stored-checkpoints" (toString (int64 .Values.node.storedCheckpoints)) }}
{{- $stored = concat $stored (list "--stored-checkpoint-bytes" (toString .Values.node.storedCheckpointBytes)) }}
{{- join "," (concat $stored .Values.node.engineArgs) }}
{{- end }}

{{/* Egress both components need once it is restricted: DNS, the in-chart Redis, and the peers the
operator names for an external Redis and S3 (`networkPolicy.egressTo`: NetworkPolicyEgressRule items). */}}
{{- define "slotkeeper.networkPolicy.egress" -}}
- ports:
    - {protocol: UDP, port: 53}
    - {protocol: TCP, port: 53}
{{- if eq (include "slotkeeper.redisMode" .) "standalone" }}
- to:
    - podSelector:
        matchLabels:
          {{- include "slotkeeper.selectorLabels" (list . "redis") | nindent 10 }}
  ports:
    - {protocol: TCP, port: 6379}
{{- end }}
{{- if .Values.s3.inCluster.enabled }}
- to:
    - podSelector:
        matchLabels:
          {{- include "slotkeeper.selectorLabels" (list . "s3") | nindent 10 }}
  ports:
    - {protocol: TCP, port: {{ int .Values.s3.inCluster.port }}}
{{- end }}
{{- with .Values.networkPolicy.egressTo }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The internal credential: internalKey.value, else the one this release's Secret already holds
(`lookup`: kept across upgrades), else a new random one. Computed once per render (cached in the
values), so the Secret and the checksums agree. */}}
{{- define "slotkeeper.internalKey" -}}
{{- if .Values.internalKey.value }}
{{- .Values.internalKey.value }}
{{- else }}
{{- $cache := .Values.internalKey }}
{{- if not (hasKey $cache "generated") }}
{{- $kept := "" }}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "slotkeeper.secret.name" .) }}
{{- if and $old $old.data (hasKey $old.data "internal-key") }}
{{- $kept = index $old.data "internal-key" | b64dec }}
{{- end }}
{{- $_ := set $cache "generated" (default (randAlphaNum 48) $kept) }}
{{- end }}
{{- $cache.generated }}
{{- end }}
{{- end }}

{{- define "slotkeeper.s3.name" -}}{{ include "slotkeeper.fullname" . }}-s3{{- end }}

{{/* The S3 endpoint: the in-chart SeaweedFS's Service with s3.inCluster, else s3.endpoint. */}}
{{- define "slotkeeper.s3Endpoint" -}}
{{- if .Values.s3.inCluster.enabled }}
{{- printf "http://%s.%s.svc.%s:%d" (include "slotkeeper.s3.name" .) .Release.Namespace .Values.clusterDomain (int .Values.s3.inCluster.port) }}
{{- else }}
{{- .Values.s3.endpoint }}
{{- end }}
{{- end }}

{{/* The in-chart SeaweedFS's identities: one, with the chart's S3 keys. */}}
{{- define "slotkeeper.s3Config" -}}
{{- $identity := dict "name" "slotkeeper" "actions" (list "Admin" "Read" "List" "Tagging" "Write") "credentials" (list (dict "accessKey" .Values.s3.accessKey "secretKey" .Values.s3.secretKey)) }}
{{- dict "identities" (list $identity) | toJson }}
{{- end }}

{{/* The models volume: node.modelVolume.source as given, else an emptyDir that the chart's init
containers fill (node.modelDownload.files, node.demoModels). */}}
{{- define "slotkeeper.modelSource" -}}
{{- $source := .Values.node.modelVolume.source }}
{{- if $source }}
{{- toYaml $source }}
{{- else if or .Values.node.modelDownload.files .Values.node.demoModels }}
{{- toYaml (dict "emptyDir" (dict "sizeLimit" .Values.node.modelVolume.sizeLimit)) }}
{{- else }}
{{- fail "node.models need a source: node.modelDownload.files (URLs with their sha256), node.modelVolume.source (e.g. an existing PVC: {persistentVolumeClaim: {claimName: models, readOnly: true}}), or node.demoModels (random-weight test models)" }}
{{- end }}
{{- end }}

{{/* Init containers of the node pods: demo models, then downloads, then the bucket; the user's own
after them. */}}
{{- define "slotkeeper.node.initContainers" -}}
{{- $mount := trimSuffix "/" .Values.node.modelVolume.mountPath }}
{{- range .Values.node.demoModels }}
- name: make-model-{{ .arch | lower }}
  image: {{ include "slotkeeper.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command: [sh, -c]
  args:
    - test -s "$OUT" || slotkeeper make-model --arch {{ .arch }} --size tiny "$OUT"
  env:
    - name: OUT
      value: {{ printf "%s/%s" $mount .path | quote }}
  {{- with $.Values.node.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - {name: models, mountPath: {{ $mount }}}
    - {name: tmp, mountPath: /tmp}
{{- end }}
{{- with .Values.node.modelDownload.files }}
- name: fetch-models
  image: "{{ $.Values.node.modelDownload.image.repository }}:{{ $.Values.node.modelDownload.image.tag }}"
  imagePullPolicy: {{ $.Values.node.modelDownload.image.pullPolicy }}
  command: [sh, -c, {{ $.Files.Get "files/fetch-models.sh" | quote }}]
  env:
    - name: MODELS_DIR
      value: {{ $mount | quote }}
    - name: MODELS
      value: |
        {{- range . }}
        {{- if not (regexMatch "^[0-9a-f]{64}$" (.sha256 | default "")) }}{{ fail (printf "node.modelDownload.files: %s needs its sha256 (64 hex digits)" (.url | default .path)) }}{{ end }}
        {{ .sha256 }} {{ required "node.modelDownload.files: every entry needs a path" .path }} {{ required "node.modelDownload.files: every entry needs a url" .url }}
        {{- end }}
  {{- with $.Values.node.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - {name: models, mountPath: {{ $mount }}}
{{- end }}
{{- include "slotkeeper.bucketInit" (list . "node") }}
{{- with .Values.node.initContainers }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* With the in-chart S3: an init container that waits for it and creates the bucket (every gateway
and node pod runs it; an existing bucket is fine). Include with (list $ "gateway"|"node"). */}}
{{- define "slotkeeper.bucketInit" -}}
{{- $ := index . 0 }}
{{- $component := index . 1 }}
{{- if $.Values.s3.inCluster.enabled }}
- name: s3-bucket
  image: {{ include "slotkeeper.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command: ["python3", "-c", {{ $.Files.Get "files/s3-bucket.py" | quote }}]
  envFrom:
    - configMapRef:
        name: {{ include "slotkeeper.fullname" $ }}-{{ $component }}-env
  env:
    {{- include "slotkeeper.secretEnv.s3" $ | trim | nindent 4 }}
  {{- with (index $.Values $component).securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    requests: {cpu: 10m, memory: 64Mi}
    limits: {memory: 256Mi}
{{- end }}
{{- end }}
