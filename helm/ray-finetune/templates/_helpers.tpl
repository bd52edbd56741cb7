{{/*
Names, labels, images and the values derived from several places (worker count, storage).
Every object is named after the experiment: one name is the identity of a run, on the volume and in the cluster.
*/}}

{{/* Where the ConfigMap (training.yaml) is mounted, read-only, in head and workers. */}}
{{- define "ray-finetune.configDir" -}}/etc/finetune{{- end }}

{{/* The experiment name: training.experiment.name, or the release name. Checked in validate.yaml. */}}
{{- define "ray-finetune.experiment" -}}
{{- $name := dig "experiment" "name" "" (.Values.training | default dict) | toString -}}
{{- if or (eq $name "") (eq $name "<nil>") }}{{ $name = .Release.Name }}{{ end -}}
{{- $name -}}
{{- end }}

{{/*
What a deployed RayJob was made from: the chart version and every value. KubeRay does not apply changes to a
RayJob that has started (and owns parts of its spec, so a changed server-side apply conflicts); validate.yaml
compares this with the live RayJob's to refuse such an upgrade with the fix instead. The prepare group is left out:
it changes no training RayJob (and a prepare release renders no training RayJob).
*/}}
{{- define "ray-finetune.valuesChecksum" -}}
{{- printf "%s %s" .Chart.Version (toJson (omit .Values "prepare")) | sha256sum | trunc 16 -}}
{{- end }}

{{- define "ray-finetune.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
ray-finetune/experiment: {{ include "ray-finetune.experiment" . }}
{{- end }}

{{- define "ray-finetune.labels" -}}
{{ include "ray-finetune.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
image: call with (dict "root" $ "override" .Values.head.image). repository@digest when a digest is set (the
override's, else image.digest unless the override names another repository or tag), else repository:tag.
*/}}
{{- define "ray-finetune.image" -}}
{{- $o := .override | default dict -}}
{{- $repo := $o.repository | default .root.Values.image.repository -}}
{{- $tag := $o.tag | default .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- $digest := $o.digest -}}
{{- if and (not $digest) (not $o.repository) (not $o.tag) }}{{ $digest = .root.Values.image.digest }}{{ end -}}
{{- if $digest }}{{ printf "%s@%s" $repo $digest }}{{ else }}{{ printf "%s:%s" $repo (toString $tag) }}{{ end -}}
{{- end }}

{{/* The worker groups that are enabled, as a list of (dict "name" NAME "spec" SPEC), in name order. */}}
{{- define "ray-finetune.groups" -}}
{{- $out := list -}}
{{- range $name, $g := .Values.workers }}
{{- if and $g (ne (toString (dig "enabled" true $g)) "false") }}
{{- $out = append $out (dict "name" $name "spec" $g) }}
{{- end }}
{{- end }}
{{- toJson $out -}}
{{- end }}

{{/* Pods of one group at most: maxReplicas with autoscaling, else replicas; times numOfHosts. */}}
{{- define "ray-finetune.groupPods" -}}
{{- $g := .spec -}}
{{- $replicas := ternary ($g.maxReplicas | default 0) ($g.replicas | default 0) (.root.Values.autoscaling.enabled | default false) -}}
{{- mul (int $replicas) (int ($g.numOfHosts | default 1)) -}}
{{- end }}

{{/* Total GPUs and pods of the enabled worker groups, as JSON {"gpus": N, "pods": M, "detail": "..."}. */}}
{{- define "ray-finetune.capacity" -}}
{{- $gpus := 0 -}}{{- $pods := 0 -}}{{- $detail := list -}}
{{- range (include "ray-finetune.groups" . | fromJsonArray) }}
{{- $n := include "ray-finetune.groupPods" (dict "root" $ "spec" .spec) | int -}}
{{- $per := int (.spec.gpus | default 0) -}}
{{- $gpus = add $gpus (mul $n $per) -}}
{{- $pods = add $pods $n -}}
{{- $detail = append $detail (printf "workers.%s: %d pods x %d GPUs" .name $n $per) -}}
{{- end }}
{{- toJson (dict "gpus" $gpus "pods" $pods "detail" (join ", " $detail)) -}}
{{- end }}

{{/*
Ray Train workers: training.scaling.num_workers when set, else one per GPU of the worker groups
(with use_gpu false: one per worker pod). validate.yaml fails when an explicit value exceeds the GPUs.
*/}}
{{- define "ray-finetune.numWorkers" -}}
{{- $scaling := (include "ray-finetune.training" . | fromJson).scaling -}}
{{- $explicit := toString (dig "num_workers" "" $scaling) -}}
{{- if and (ne $explicit "") (ne $explicit "<nil>") -}}
{{- int $scaling.num_workers -}}
{{- else -}}
{{- $cap := include "ray-finetune.capacity" . | fromJson -}}
{{- if $scaling.use_gpu }}{{ int $cap.gpus }}{{ else }}{{ int $cap.pods }}{{ end -}}
{{- end -}}
{{- end }}

{{/*
A securityContext: the chart-wide one (podSecurityContext or securityContext) with a group's keys merged over
it. Call with (dict "base" .Values.securityContext "group" .Values.head.securityContext).
*/}}
{{- define "ray-finetune.securityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy (.base | default dict)) (deepCopy (.group | default dict))) -}}
{{- end }}

{{/* Fails when an image tag is not a valid tag (e.g. a digest written as tag). Renders nothing. */}}
{{- define "ray-finetune.checkImage" -}}
{{- $tag := toString (dig "tag" "" (.image | default dict)) -}}
{{- if hasPrefix "sha256:" $tag }}
{{- fail (printf "%s.tag: %q is a digest, and repository:sha256:... is not a valid image reference. Fix: --set %s.digest=%s and leave %s.tag empty" .where $tag .where $tag .where) }}
{{- end }}
{{- if and $tag (not (regexMatch "^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$" $tag)) }}
{{- fail (printf "%s.tag: %q is not a valid image tag (letters, digits, '_', '.', '-'; at most 128; no ':' or '@'). Fix: the tag alone, e.g. 0.1.0, and a digest in %s.digest" .where $tag .where) }}
{{- end }}
{{- end }}

{{/*
Names that look like secrets (the app's driver.SECRET_NAME is the same rule: tests/test_security.py compares).
A literal value under such a name would be readable by anyone who may read the RayJob or the ConfigMap.
*/}}
{{- define "ray-finetune.secretName" -}}(?i)(^|_)(TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(_|$){{- end }}

{{/* Fails when an env list (EnvVar) gives a secret-looking variable a literal value. (dict "where" W "env" LIST) */}}
{{- define "ray-finetune.checkEnv" -}}
{{- range $i, $e := .env | default list }}
{{- if and (regexMatch (include "ray-finetune.secretName" "") (toString $e.name)) (hasKey $e "value") }}
{{- fail (printf "%s[%d]: %s has a literal value, which would be readable by anyone who may read the RayJob (kubectl get rayjob -o yaml). Fix: put it in a Secret and use valueFrom: {secretKeyRef: {name: SECRET, key: KEY}} instead of value" $.where $i $e.name) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Fails when a key that looks like a secret holds a literal string in the training config. (dict "path" P "value" V) */}}
{{- define "ray-finetune.checkConfigSecrets" -}}
{{- $path := .path }}
{{- if kindIs "map" .value }}
{{- range $k, $v := .value }}
{{- if and (regexMatch (include "ray-finetune.secretName" "") $k) (kindIs "string" $v) $v }}
{{- fail (printf "%s.%s: a literal secret in the training config lands in the ConfigMap, readable by anyone who may read ConfigMaps. Fix: leave it out and give the variable the library reads (e.g. COMET_API_KEY, WANDB_API_KEY) through env with valueFrom.secretKeyRef" $path $k) }}
{{- end }}
{{- include "ray-finetune.checkConfigSecrets" (dict "path" (printf "%s.%s" $path $k) "value" $v) }}
{{- end }}
{{- else if kindIs "slice" .value }}
{{- range $i, $v := .value }}
{{- include "ray-finetune.checkConfigSecrets" (dict "path" (printf "%s[%d]" $path $i) "value" $v) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A Ray container's resources: as given, plus an ephemeral-storage request of the /tmp/ray size when the
requests name none, so the scheduler places the pod where its logs and spills fit. No limit is added.
Quantities are written as strings, the form the operator writes back into the RayJob: a number there (gpus: 1)
differs from the operator's "1" and hands the worker groups to the operator under server-side apply, so every
later `helm upgrade` would conflict.
*/}}
{{- define "ray-finetune.resources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- $req := $res.requests | default dict -}}
{{- if not (hasKey $req "ephemeral-storage") }}{{ $_ := set $req "ephemeral-storage" .tmpSize }}{{ end -}}
{{- $_ := set $res "requests" $req -}}
{{- range $kind := list "requests" "limits" }}
{{- $quantities := dict }}
{{- range $name, $q := (get $res $kind | default dict) }}{{ $_ := set $quantities $name (toString $q) }}{{ end }}
{{- if hasKey $res $kind }}{{ $_ := set $res $kind $quantities }}{{ end }}
{{- end -}}
{{- toYaml $res -}}
{{- end }}

{{/* The head's dashboard port (Ray's default 8265, or head.rayStartParams.dashboard-port). */}}
{{- define "ray-finetune.dashboardPort" -}}
{{- int (dig "dashboard-port" 8265 (.Values.head.rayStartParams | default dict)) -}}
{{- end }}

{{/*
training.* as the chart's checks read it: the values over the app's defaults of the keys they read
(_app_defaults.tpl, generated from the app's models). Only for reading: the ConfigMap holds the values as given.
*/}}
{{- define "ray-finetune.training" -}}
{{- $t := deepCopy (.Values.training | default dict) -}}
{{- range $section, $keys := include "ray-finetune.appDefaults" . | fromJson }}
{{- $s := get $t $section | default dict -}}
{{- range $k, $v := $keys }}
{{- if or (not (hasKey $s $k)) (eq (toString (get $s $k)) "<nil>") }}{{ $_ := set $s $k $v }}{{ end }}
{{- end }}
{{- $_ := set $t $section $s -}}
{{- end }}
{{- toJson $t -}}
{{- end }}

{{/* The mount path without a trailing slash. */}}
{{- define "ray-finetune.mountPath" -}}
{{- $p := trimSuffix "/" .Values.storage.mountPath -}}
{{- $p | default "/" -}}
{{- end }}

{{- define "ray-finetune.claimName" -}}
{{- if .Values.storage.existingClaim }}{{ .Values.storage.existingClaim }}{{ else }}{{ include "ray-finetune.experiment" . }}{{ end -}}
{{- end }}

{{/*
Whether the head pod mounts a ServiceAccount token ("true"/"false"): only when something on it calls the API.
KubeRay's autoscaler sidecar does; so does the driver, which reads its own RayJob's uid for the experiment lease
and whether the RayJob of a stale lease's holder still exists (app/lease.py), whenever the chart creates the
account and its Role.
*/}}
{{- define "ray-finetune.headToken" -}}
{{- or .Values.autoscaling.enabled (and .Values.progressReporting.enabled .Values.progressReporting.rbac.create) -}}
{{- end }}

{{- define "ray-finetune.serviceAccountName" -}}
{{- if and .Values.progressReporting.enabled .Values.progressReporting.rbac.create -}}
{{ include "ray-finetune.experiment" . }}
{{- else -}}
{{ .Values.head.serviceAccountName }}
{{- end -}}
{{- end }}

{{/*
The RayJob entrypoint: the mounted config, plus what the deployment decides (scale and identity). With
prepare.enabled: `finetune prepare` of the same config with the same arguments (the training groups' worker count,
so the config passes the same checks as the training job that will use the data).
*/}}
{{- define "ray-finetune.entrypoint" -}}
{{ ternary "finetune prepare" "finetune train" (.Values.prepare.enabled | default false) }} {{ include "ray-finetune.configDir" . }}/training.yaml --set scaling.num_workers={{ include "ray-finetune.numWorkers" . }} --set experiment.name={{ include "ray-finetune.experiment" . }}
{{- end }}

{{/*
Each GPU's memory for the app's auto settings, which training.yaml's scaling.gpu_memory takes (_config.tpl): the
gpuMemory of the GPU worker groups, when training.scaling.gpu_memory does not set it; empty when no group sets it (the
app then asks the cluster). validate.yaml fails when the GPU groups disagree or only some set it.
*/}}
{{- define "ray-finetune.gpuMemory" -}}
{{- $own := dig "scaling" "gpu_memory" "" (.Values.training | default dict) | toString -}}
{{- if or (eq $own "") (eq $own "<nil>") -}}
{{- $sizes := list -}}
{{- range (include "ray-finetune.groups" . | fromJsonArray) }}
{{- if gt (int (.spec.gpus | default 0)) 0 }}{{ $sizes = append $sizes (toString (.spec.gpuMemory | default "")) }}{{ end -}}
{{- end }}
{{- $sizes = uniq $sizes -}}
{{- if eq (len $sizes) 1 }}{{ first $sizes }}{{ end -}}
{{- end -}}
{{- end }}

{{/*
The RayJob's name: the experiment's, or with prepare.enabled <experiment>-prepare (validate.yaml keeps it within
KubeRay's 47 characters).
*/}}
{{- define "ray-finetune.jobName" -}}
{{- include "ray-finetune.experiment" . }}{{ if .Values.prepare.enabled }}-prepare{{ end -}}
{{- end }}

{{/*
toYaml, with floats that Go writes as 1e-06 given a decimal point (1.0e-06): YAML 1.1 readers such as
PyYAML read an exponent without a point as a string.
*/}}
{{- define "ray-finetune.toYaml" -}}
{{- regexReplaceAll "(?m)(^|: |- )(-?[0-9]+)(e[-+][0-9]+)$" (toYaml .) "${1}${2}.0${3}" -}}
{{- end }}

{{/*
The NetworkPolicy egress rule to the MLflow server: tracking.mlflow.egressTo on the port of
training.tracking.mlflow.uri (its scheme's default when it names none); empty without both.
*/}}
{{- define "ray-finetune.mlflowEgress" -}}
{{- $uri := (((.Values.training).tracking).mlflow).uri | default "" }}
{{- $to := .Values.tracking.mlflow.egressTo }}
{{- if and $uri $to }}
{{- $url := urlParse $uri }}
{{- $port := (regexFind ":[0-9]+$" $url.host) | trimPrefix ":" | default (ternary "443" "80" (eq $url.scheme "https")) }}
- to:
    {{- toYaml $to | nindent 4 }}
  ports:
    - protocol: TCP
      port: {{ $port }}
{{- end }}
{{- end }}
