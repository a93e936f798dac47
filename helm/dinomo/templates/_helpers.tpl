{{/*
Names. Every name another object (or the monitor's config) refers to is defined here once and
used everywhere through `include`, so the monitor's [orchestrator.kubernetes] section names the
very StatefulSet, Service, port and Lease that the chart renders.
*/}}

{{- define "dinomo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every resource name. At most 40 characters, so "<prefix>-monitor" and the
StatefulSet names stay well inside the 52 characters a StatefulSet name may use (its pods get a
controller-revision-hash label that appends 11 characters). */}}
{{- define "dinomo.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dinomo.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The dpm-node's StatefulSet and its headless Service (same name). */}}
{{- define "dinomo.dpm.name" -}}
{{- printf "%s-dpm" (include "dinomo.fullname" .) -}}
{{- end -}}

{{/* The stable DNS name of the one dpm-node pod, through its headless Service. */}}
{{- define "dinomo.dpm.host" -}}
{{- printf "%s-0.%s.%s.svc" (include "dinomo.dpm.name" .) (include "dinomo.dpm.name" .) .Release.Namespace -}}
{{- end -}}

{{/* Whether the monitor fails the dpm-node replica set over (backups, automaticFailover). */}}
{{- define "dinomo.dpm.autoFailover" -}}
{{- if and (gt (int64 .Values.dpm.replication.backups) 0) .Values.dpm.replication.automaticFailover -}}
true
{{- end -}}
{{- end -}}

{{/* The Service that selects the primary's pod by the label the monitor sets. */}}
{{- define "dinomo.dpmPrimary.name" -}}
{{- printf "%s-dpm-primary" (include "dinomo.fullname" .) -}}
{{- end -}}

{{/* The pod label the monitor sets on the serving primary (monitor dpm_replicas.primary_label). */}}
{{- define "dinomo.dpmPrimary.label" -}}
dinomo.io/dpm-primary
{{- end -}}

{{/* The dpm-node's gRPC address, given to the KV nodes, routing nodes and monitor:
dpm.address (a promoted backup's, after a manual failover), the primary Service when the
monitor fails over, or the dpm StatefulSet's pod. */}}
{{- define "dinomo.dpm.address" -}}
{{- if .Values.dpm.address -}}
{{- .Values.dpm.address -}}
{{- else if include "dinomo.dpm.autoFailover" . -}}
{{- printf "%s.%s.svc:%d" (include "dinomo.dpmPrimary.name" .) .Release.Namespace (int64 .Values.dpm.port) -}}
{{- else -}}
{{- printf "%s:%d" (include "dinomo.dpm.host" .) (int64 .Values.dpm.port) -}}
{{- end -}}
{{- end -}}

{{/* The StatefulSet (and headless Service) of the dpm-node's backups. */}}
{{- define "dinomo.dpmBackup.name" -}}
{{- printf "%s-dpm-backup" (include "dinomo.fullname" .) -}}
{{- end -}}

{{/* The gRPC address of backup pod N. Call with (dict "ctx" $ "index" N). */}}
{{- define "dinomo.dpmBackup.address" -}}
{{- $name := include "dinomo.dpmBackup.name" .ctx -}}
{{- printf "%s-%d.%s.%s.svc:%d" $name (int64 .index) $name .ctx.Release.Namespace (int64 .ctx.Values.dpm.port) -}}
{{- end -}}

{{/* The KV StatefulSet: the monitor's orchestrator.kubernetes.statefulset. */}}
{{- define "dinomo.kv.name" -}}
{{- printf "%s-kn" (include "dinomo.fullname" .) -}}
{{- end -}}

{{/* The KV headless Service: the monitor's orchestrator.kubernetes.service, the
StatefulSet's serviceName and the middle of every KN's advertised name. */}}
{{- define "dinomo.kv.serviceName" -}}
{{- include "dinomo.kv.name" . -}}
{{- end -}}

{{- define "dinomo.routing.name" -}}
{{- printf "%s-routing" (include "dinomo.fullname" .) -}}
{{- end -}}

{{/* The routing Service's address inside the cluster. */}}
{{- define "dinomo.routing.address" -}}
{{- printf "%s.%s.svc:%d" (include "dinomo.routing.name" .) .Release.Namespace (int64 .Values.routing.port) -}}
{{- end -}}

{{- define "dinomo.monitor.name" -}}
{{- printf "%s-monitor" (include "dinomo.fullname" .) -}}
{{- end -}}

{{/* The Lease electing the active monitor. */}}
{{- define "dinomo.monitor.leaseName" -}}
{{- default (include "dinomo.monitor.name" .) .Values.monitor.config.orchestrator.lease_name -}}
{{- end -}}

{{- define "dinomo.monitor.serviceAccountName" -}}
{{- default (include "dinomo.monitor.name" .) .Values.monitor.serviceAccount.name -}}
{{- end -}}

{{- define "dinomo.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels. Call with (dict "ctx" $ "component" "kn"). */}}
{{- define "dinomo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dinomo.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "dinomo.labels" -}}
{{ include "dinomo.selectorLabels" . }}
app.kubernetes.io/part-of: dinomo
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "dinomo.chart" .ctx }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The metrics listen address of a node: 0.0.0.0:<port>, or "" when metrics are off.
Call with (dict "ctx" $ "port" N). */}}
{{- define "dinomo.metricsListen" -}}
{{- if .ctx.Values.metrics.enabled -}}
{{- printf "0.0.0.0:%d" (int64 .port) -}}
{{- end -}}
{{- end -}}

{{/* A float as TOML: always with a decimal point or an exponent, so the monitor reads an f64. */}}
{{- define "dinomo.tomlFloat" -}}
{{- $s := toString . -}}
{{- if or (contains "." $s) (contains "e" $s) (contains "E" $s) -}}
{{- $s -}}
{{- else -}}
{{- printf "%s.0" $s -}}
{{- end -}}
{{- end -}}

{{/* A gRPC probe (grpc.health.v1, service "") on a node's plain-text health port (its
--health-addr; kubelet cannot present a client certificate to the mutual-TLS gRPC port). Call
with (dict "port" .Values.x.healthPort "probe" .Values.x.readinessProbe). */}}
{{- define "dinomo.grpcProbe" -}}
grpc:
  port: {{ int64 .port }}
initialDelaySeconds: {{ int64 .probe.initialDelaySeconds }}
periodSeconds: {{ int64 .probe.periodSeconds }}
timeoutSeconds: {{ int64 .probe.timeoutSeconds }}
failureThreshold: {{ int64 .probe.failureThreshold }}
{{- end -}}

{{/* Pod anti-affinity against the pods of the same component. Call with
(dict "ctx" $ "component" "kn" "mode" "preferred"). Renders nothing for "none". */}}
{{- define "dinomo.antiAffinity" -}}
{{- if eq .mode "required" }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "dinomo.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 12 }}
{{- else if eq .mode "preferred" }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "dinomo.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 14 }}
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by every pod: pull secrets, security context, scheduling.
Call with (dict "ctx" $ "values" .Values.kv). */}}
{{- define "dinomo.podCommon" -}}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with .ctx.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod annotations: the RDMA network (Multus) for the dpm-node, its verbs backups and KV nodes, a config
checksum, and the component's podAnnotations. Call with
(dict "ctx" $ "rdma" true "checksum" "<sha>" "extra" .Values.kv.podAnnotations). */}}
{{- define "dinomo.podAnnotations" -}}
{{- $a := dict -}}
{{- if and .rdma .ctx.Values.rdma.enabled .ctx.Values.rdma.networks -}}
{{- $_ := set $a "k8s.v1.cni.cncf.io/networks" .ctx.Values.rdma.networks -}}
{{- end -}}
{{- with .checksum -}}
{{- $_ := set $a "checksum/config" . -}}
{{- end -}}
{{- range $k, $v := (default (dict) .extra) -}}
{{- $_ := set $a $k $v -}}
{{- end -}}
{{- if $a }}
annotations:
  {{- toYaml $a | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod-level RDMA settings (host network) for the dpm-node, its verbs backups and KV node pods. */}}
{{- define "dinomo.rdma.podSpec" -}}
{{- if and .Values.rdma.enabled .Values.rdma.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end -}}

{{/* Container resources, with the RDMA device added for the dpm-node, its verbs backups and KV nodes.
Call with (dict "ctx" $ "resources" .Values.kv.resources "rdma" true). */}}
{{- define "dinomo.resources" -}}
{{- $res := deepCopy (default (dict) .resources) -}}
{{- if and .rdma .ctx.Values.rdma.enabled -}}
{{- $limits := deepCopy (default (dict) (get $res "limits")) -}}
{{- $_ := set $limits .ctx.Values.rdma.resourceName (int64 .ctx.Values.rdma.resourceCount) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- if $res }}
resources:
  {{- toYaml $res | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Container security context. Call with (dict "ctx" $ "rdma" true "privileged" false). */}}
{{- define "dinomo.containerSecurityContext" -}}
securityContext:
{{- if and .rdma .ctx.Values.rdma.enabled .ctx.Values.rdma.ipcLock }}
  # IPC_LOCK takes effect only for uid 0 (Kubernetes never raises RLIMIT_MEMLOCK).
  runAsUser: 0
  runAsNonRoot: false
{{- end }}
{{- if .privileged }}
  privileged: true
{{- else }}
  allowPrivilegeEscalation: false
  capabilities:
    drop: ["ALL"]
    {{- if and .rdma .ctx.Values.rdma.enabled .ctx.Values.rdma.ipcLock }}
    add: ["IPC_LOCK"]
    {{- end }}
{{- end }}
{{- end -}}

{{/* --rdma-device for the dpm-node, its backups and KV nodes, when the fabric is verbs and a device is named. */}}
{{- define "dinomo.rdmaDeviceArg" -}}
{{- if and (eq .Values.dpm.fabric.kind "verbs") .Values.rdma.device }}
- --rdma-device={{ .Values.rdma.device }}
{{- end }}
{{- end -}}

{{/* DINOMO_LOG, when set. */}}
{{- define "dinomo.logEnv" -}}
{{- with .Values.logLevel }}
- name: DINOMO_LOG
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* TLS. The identities, as security/src/issue.rs (`standard_leaves`) issues them for
`dinomo up`: per identity of the chart, the role and name of its SAN URI dinomo://<role>/<name>
and, for a server, the DNS name of the service it proves (callers verify servers by it). */}}
{{- define "dinomo.tls.identities" -}}
dpm: {role: node, name: dpm, dns: dpm.dinomo}
kv: {role: node, name: kn, dns: kv.dinomo}
routing: {role: node, name: routing, dns: routing.dinomo}
monitor: {role: monitor, name: monitor, dns: monitor.dinomo}
admin: {role: admin, name: default, dns: ""}
client: {role: client, name: default, dns: ""}
{{- end -}}

{{/* Where every pod finds its own identity (DINOMO_CREDENTIALS), and where the monitor pods
also find the admin identity (for `kubectl exec ... dinomo admin`). */}}
{{- define "dinomo.tls.dir" -}}/etc/dinomo/credentials{{- end -}}
{{- define "dinomo.tls.adminDir" -}}/etc/dinomo/admin-credentials{{- end -}}

{{/* The Secret holding an identity: cert-manager's <fullname>-<id>-tls, or
tls.existingSecrets.<id>. Call with (dict "ctx" $ "id" "dpm"). */}}
{{- define "dinomo.tls.secretName" -}}
{{- if .ctx.Values.tls.certManager.issuerRef.name -}}
{{- printf "%s-%s-tls" (include "dinomo.fullname" .ctx) .id -}}
{{- else -}}
{{- get .ctx.Values.tls.existingSecrets .id -}}
{{- end -}}
{{- end -}}

{{/* The container env that tells a node (or a client) its credentials, or --insecure. */}}
{{- define "dinomo.tls.env" -}}
{{- if .Values.tls.enabled }}
- name: DINOMO_CREDENTIALS
  value: {{ include "dinomo.tls.dir" . }}
{{- else }}
# tls.enabled is false: no TLS and no access checks (--insecure).
- name: DINOMO_INSECURE
  value: "true"
{{- end }}
{{- end -}}

{{/* The identity's Secret as a volume mount / a volume, when TLS is on. Call with
(dict "ctx" $ "volume" "credentials" "path" "/etc/dinomo/credentials") and
(dict "ctx" $ "volume" "credentials" "id" "dpm"). */}}
{{- define "dinomo.tls.volumeMount" -}}
{{- if .ctx.Values.tls.enabled }}
- name: {{ .volume }}
  mountPath: {{ .path }}
  readOnly: true
{{- end }}
{{- end -}}
{{- define "dinomo.tls.volume" -}}
{{- if .ctx.Values.tls.enabled }}
- name: {{ .volume }}
  secret:
    secretName: {{ include "dinomo.tls.secretName" (dict "ctx" .ctx "id" .id) }}
    defaultMode: 0444
{{- end }}
{{- end -}}

{{/* Checks across values that the schema cannot express; fails the render with a message. */}}
{{- define "dinomo.validate" -}}
{{- $p := .Values.monitor.config.policy -}}
{{- $o := .Values.monitor.config.orchestrator -}}
{{- $f := .Values.monitor.config.failure -}}
{{- if and (eq .Values.dpm.fabric.kind "verbs") (not .Values.rdma.enabled) -}}
{{- fail "dpm.fabric.kind: \"verbs\" needs rdma.enabled: true (the pods need the RDMA device, network and IPC_LOCK)" -}}
{{- end -}}
{{- if and (include "dinomo.dpm.autoFailover" .) (lt (int64 $o.lease_duration_secs) 15) -}}
{{- fail "monitor.config.orchestrator.lease_duration_secs must be at least 15 with dpm.replication.automaticFailover: the monitor moves the primary label up to 7 s after renewing its Lease, which must stay within half of it" -}}
{{- end -}}
{{- if and (gt (int64 .Values.dpm.replication.backups) 0) (eq .Values.dpm.pm.type "devdax") -}}
{{- fail "dpm.replication.backups with dpm.pm.type devdax is not offered: a backup's pool would be the node's device itself (one scheduled on the primary's node would zero the primary's pool when attached) and its term file would sit in the container's /dev, forgotten at restart" -}}
{{- end -}}
{{- if ge (float64 $p.under_utilized) (float64 $p.over_utilized) -}}
{{- fail "monitor.config.policy.under_utilized must be below over_utilized" -}}
{{- end -}}
{{- if lt (int64 $p.max_kns) (int64 $p.min_kns) -}}
{{- fail "monitor.config.policy.max_kns must be at least min_kns" -}}
{{- end -}}
{{- if eq (int64 $p.max_replication) 1 -}}
{{- fail "monitor.config.policy.max_replication = 1 would forbid replication; use 0 or at least 2" -}}
{{- end -}}
{{- if le (int64 $f.failed_after_ms) (int64 $f.probe_every_ms) -}}
{{- fail "monitor.config.failure.failed_after_ms must be above probe_every_ms" -}}
{{- end -}}
{{- if ge (mul (int64 $p.epoch_ms) 2) (mul (int64 $o.lease_duration_secs) 1000) -}}
{{- fail "monitor.config.policy.epoch_ms must be shorter than half of monitor.config.orchestrator.lease_duration_secs (a leader acts only while its last Lease renewal is younger than that)" -}}
{{- end -}}
{{- if le (int64 $o.stop_timeout_ms) (mul (int64 .Values.kv.terminationGracePeriodSeconds) 1000) -}}
{{- fail "monitor.config.orchestrator.stop_timeout_ms must be longer than kv.terminationGracePeriodSeconds (the monitor waits that long for a removed KN's pod to be gone)" -}}
{{- end -}}
{{- if or (lt (int64 .Values.kv.replicas) (int64 $p.min_kns)) (gt (int64 .Values.kv.replicas) (int64 $p.max_kns)) -}}
{{- fail "kv.replicas must be within monitor.config.policy.min_kns..max_kns" -}}
{{- end -}}
{{- $ports := list (int64 .Values.dpm.port) (int64 .Values.dpm.fabric.port) (int64 .Values.dpm.metricsPort) (int64 .Values.dpm.healthPort) -}}
{{- if not (eq (len (uniq $ports)) (len $ports)) -}}
{{- fail "dpm.port, dpm.fabric.port, dpm.metricsPort and dpm.healthPort must differ" -}}
{{- end -}}
{{- range $c := list .Values.kv .Values.routing .Values.monitor -}}
{{- $p := list (int64 $c.port) (int64 $c.metricsPort) (int64 $c.healthPort) -}}
{{- if not (eq (len (uniq $p)) (len $p)) -}}
{{- fail "a component's port, metricsPort and healthPort must differ" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.rdma.enabled .Values.rdma.hostNetwork -}}
{{- $host := concat $ports (list (int64 .Values.kv.port) (int64 .Values.kv.metricsPort) (int64 .Values.kv.healthPort)) -}}
{{- if not (eq (len (uniq $host)) (len $host)) -}}
{{- fail "with rdma.hostNetwork the dpm-node and KV nodes share the node's ports: the dpm.* and kv.* ports (port, fabric.port, metricsPort, healthPort) must all differ" -}}
{{- end -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- $issuer := .Values.tls.certManager.issuerRef.name -}}
{{- $named := list -}}
{{- $missing := list -}}
{{- range $id := list "dpm" "kv" "routing" "monitor" "admin" "client" -}}
{{- if get $.Values.tls.existingSecrets $id -}}
{{- $named = append $named $id -}}
{{- else -}}
{{- $missing = append $missing $id -}}
{{- end -}}
{{- end -}}
{{- if and $issuer $named -}}
{{- fail (printf "tls: set either tls.certManager.issuerRef.name (%s) or tls.existingSecrets (%s), not both" $issuer (join ", " $named)) -}}
{{- else if and (not $issuer) (not $named) -}}
{{- fail "tls.enabled is true but no certificates are configured: set tls.certManager.issuerRef.name (cert-manager then issues one Certificate per component) or tls.existingSecrets.{dpm,kv,routing,monitor,admin,client} (pre-made Secrets with tls.crt, tls.key and ca.crt); or tls.enabled=false to run without TLS (insecure). See helm/README.md, \"TLS\"" -}}
{{- else if and (not $issuer) $missing -}}
{{- fail (printf "tls.existingSecrets: %s not set; name a Secret (tls.crt, tls.key, ca.crt) for each of dpm, kv, routing, monitor, admin and client" (join ", " $missing)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
