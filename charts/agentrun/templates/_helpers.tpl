{{/* Chart name. */}}
{{- define "agentrun.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: prefix of every object the release owns. */}}
{{- define "agentrun.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "agentrun.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "agentrun.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agentrun
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector of the controller pods. */}}
{{- define "agentrun.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agentrun.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end }}

{{/* Selector of the in-chart PostgreSQL pod. */}}
{{- define "agentrun.postgresqlSelectorLabels" -}}
app.kubernetes.io/name: {{ include "agentrun.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: postgresql
{{- end }}

{{/* Fixed: the admission policy (crds/admission.yaml) recognises the controller by this name. */}}
{{- define "agentrun.serviceAccountName" -}}
agentrun-controller
{{- end }}

{{- define "agentrun.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Namespace of the leader-election Lease: the watched one, else the release's. */}}
{{- define "agentrun.leaseNamespace" -}}
{{- default .Release.Namespace .Values.watchNamespace }}
{{- end }}

{{/* Namespaces where step pods run (their ServiceAccount is created there). */}}
{{- define "agentrun.stepNamespaces" -}}
{{- if .Values.stepRunner.serviceAccount.namespaces }}
{{- toJson (uniq .Values.stepRunner.serviceAccount.namespaces) }}
{{- else }}
{{- toJson (list (default .Release.Namespace .Values.watchNamespace)) }}
{{- end }}
{{- end }}

{{/* The Secret and key the controller reads its store URL from (only the controller: step pods use the gateway). */}}
{{- define "agentrun.storeSecret" -}}
{{- if .Values.store.existingSecret }}
{{- .Values.store.existingSecret }}
{{- else }}
{{- printf "%s-store" (include "agentrun.fullname" .) }}
{{- end }}
{{- end }}

{{- define "agentrun.storeUrlKey" -}}
{{- if .Values.store.existingSecret }}{{ .Values.store.urlKey }}{{ else }}url{{ end }}
{{- end }}

{{/* The step-log gateway's URL, as step pods reach it (the controller Service). */}}
{{- define "agentrun.stepApiUrl" -}}
{{- if .Values.controller.stepApi.url }}
{{- .Values.controller.stepApi.url }}
{{- else }}
{{- printf "http://%s-controller.%s.svc:%v" (include "agentrun.fullname" .) .Release.Namespace .Values.controller.stepApi.port }}
{{- end }}
{{- end }}

{{/* Refuse contradictory store settings at render time. */}}
{{- define "agentrun.validate" -}}
{{- $sources := 0 }}
{{- if .Values.store.existingSecret }}{{ $sources = add1 $sources }}{{ end }}
{{- if .Values.store.url }}{{ $sources = add1 $sources }}{{ end }}
{{- if .Values.postgresql.enabled }}{{ $sources = add1 $sources }}{{ end }}
{{- if ne $sources 1 }}
{{- fail "set exactly one step store: store.existingSecret (a Secret with the PostgreSQL URL), store.url, or postgresql.enabled=true (quick start)" }}
{{- end }}
{{- end }}

{{/* "true" when the render sees the cluster (helm install/upgrade; not helm template or Argo CD, whose lookups find nothing). */}}
{{- define "agentrun.seesCluster" -}}
{{- if lookup "v1" "Namespace" "" "kube-system" }}true{{ end }}
{{- end }}

{{/* The Secret of the step-token key (and the keys a rotation retired). */}}
{{- define "agentrun.stepTokenKeySecret" -}}
{{- default (printf "%s-step-token-key" (include "agentrun.fullname" .)) .Values.controller.stepTokenKey.existingSecret }}
{{- end }}

{{/* The in-chart PostgreSQL's password: the value, else the one already in the cluster, else a new one where the next render will find it. */}}
{{- define "agentrun.postgresqlPassword" -}}
{{- if .Values.postgresql.password }}
{{- .Values.postgresql.password }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (printf "%s-postgresql" (include "agentrun.fullname" .)) }}
{{- if and $existing $existing.data (hasKey $existing.data "password") }}
{{- index $existing.data "password" | b64dec }}
{{- else if not (include "agentrun.seesCluster" .) }}
{{- fail "postgresql.password: this render cannot see the cluster (helm template, Argo CD, a client-side dry run), so a password generated here would change at every render while the database keeps the first; set postgresql.password, or use store.existingSecret with a PostgreSQL of your own" }}
{{- else }}
{{- /* Stable within one render (the store URL and the server must agree). */}}
{{- $cache := .Values.postgresql }}
{{- if not (hasKey $cache "_generated") }}
{{- $_ := set $cache "_generated" (randAlphaNum 32) }}
{{- end }}
{{- $cache._generated }}
{{- end }}
{{- end }}
{{- end }}

{{/* The HTTPS port's Secret (tls.crt, tls.key, ca.crt): the chart's, cert-manager's or the controller's. */}}
{{- define "agentrun.servingCertSecret" -}}
{{- printf "%s-serving-cert" (include "agentrun.fullname" .) }}
{{- end }}

{{/* The names the API server dials the controller Service by (a JSON list): the first is what it verifies. */}}
{{- define "agentrun.servingDnsNames" -}}
{{- $svc := printf "%s-controller.%s.svc" (include "agentrun.fullname" .) .Release.Namespace }}
{{- toJson (list $svc (printf "%s.cluster.local" $svc)) }}
{{- end }}

{{/* The requester stamp this render installs: "policy", "webhook" or "" (none). See values crds.stampRequester. */}}
{{- define "agentrun.stampRequester" -}}
{{- $stamp := toString .Values.crds.stampRequester }}
{{- $served := .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1beta1/MutatingAdmissionPolicy" }}
{{- if or (eq $stamp "policy") (eq $stamp "true") (and (eq $stamp "auto") $served) }}
{{- /* The policy ships with the CRDs: not installed without them (crds/ and config/requester-stamp are the user's then). */}}
{{- if .Values.crds.install }}policy{{ end }}
{{- else if or (eq $stamp "webhook") (eq $stamp "auto") }}webhook
{{- end }}
{{- end }}

{{/* The webhook configuration's name (cluster-scoped; passed to the controller in servingCert.mode=controller). */}}
{{- define "agentrun.requesterWebhook" -}}
{{- printf "%s-requester-stamp" (include "agentrun.fullname" .) }}
{{- end }}

{{/* The log API's APIService (its name is fixed by the group and version it serves). */}}
{{- define "agentrun.apiServiceName" -}}
v1alpha1.log.agentrun.dev
{{- end }}

{{/*
servingCert.mode=chart: the certificate as {crt, key, ca} (base64 PEM, JSON),
the same for every template of one render. Kept from the cluster; generated
only where the render sees the cluster (so the next one finds it); refused
otherwise: a certificate generated by `helm template` would change at every
render, and with it the caBundle the API server trusts.
*/}}
{{- define "agentrun.servingCertData" -}}
{{- $cache := .Values.servingCert }}
{{- if not (hasKey $cache "_generated") }}
{{- $name := include "agentrun.servingCertSecret" . }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name }}
{{- $data := dig "data" (dict) (default (dict) $existing) }}
{{- if and (index $data "tls.crt") (index $data "tls.key") (index $data "ca.crt") }}
{{- $_ := set $cache "_generated" (dict "crt" (index $data "tls.crt") "key" (index $data "tls.key") "ca" (index $data "ca.crt")) }}
{{- else if include "agentrun.seesCluster" . }}
{{- $names := include "agentrun.servingDnsNames" . | fromJsonArray }}
{{- $ca := genCA "agentrun-controller-ca" 3650 }}
{{- $cert := genSignedCert (first $names) nil $names 3650 $ca }}
{{- $_ := set $cache "_generated" (dict "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc) "ca" ($ca.Cert | b64enc)) }}
{{- else }}
{{- fail (printf "servingCert.mode=chart: this render cannot see the cluster (helm template, Argo CD, a client-side dry run), so a certificate generated here would change at every render and the API server would stop trusting the controller; set servingCert.mode=controller (the controller generates it into Secret %s/%s) or servingCert.mode=certManager" .Release.Namespace $name) }}
{{- end }}
{{- end }}
{{- toJson $cache._generated }}
{{- end }}

{{/* The caBundle line, or the cert-manager annotation, of the APIService and the webhook (indented by the caller). */}}
{{- define "agentrun.caBundle" -}}
{{- if eq .Values.servingCert.mode "chart" }}
caBundle: {{ (include "agentrun.servingCertData" . | fromJson).ca }}
{{- end }}
{{- end }}

{{- define "agentrun.caInjectionAnnotations" -}}
{{- if eq .Values.servingCert.mode "certManager" }}
cert-manager.io/inject-ca-from: {{ printf "%s/%s" .Release.Namespace (include "agentrun.servingCertSecret" .) }}
{{- end }}
{{- end }}

{{/* Where the serving certificate's Secret is mounted (modes chart and certManager). */}}
{{- define "agentrun.servingCertDir" -}}
/etc/agentrun/serving-cert
{{- end }}

{{/* The controller's flags for its HTTPS port's certificate, by servingCert.mode (a YAML list). */}}
{{- define "agentrun.servingArgs" -}}
{{- if eq .Values.servingCert.mode "controller" }}
- --serving-cert-secret={{ include "agentrun.servingCertSecret" . }}
{{- range include "agentrun.servingDnsNames" . | fromJsonArray }}
- --serving-dns-name={{ . }}
{{- end }}
{{- if .Values.logApi.apiService }}
- --inject-ca-apiservice={{ include "agentrun.apiServiceName" . }}
{{- end }}
{{- if eq (include "agentrun.stampRequester" .) "webhook" }}
- --inject-ca-webhook={{ include "agentrun.requesterWebhook" . }}
{{- end }}
{{- else }}
- --serving-cert-file={{ include "agentrun.servingCertDir" . }}/tls.crt
- --serving-key-file={{ include "agentrun.servingCertDir" . }}/tls.key
{{- end }}
{{- end }}
