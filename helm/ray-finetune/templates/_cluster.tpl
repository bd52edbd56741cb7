{{/*
The RayCluster spec: used as the RayJob's rayClusterSpec (ephemeral) and as the standalone RayCluster's
spec (persistent). Head and every worker mount the checkpoint volume at the same path (storage.mountPath,
which is also training.experiment.storage_path) and the config read-only.
*/}}

{{/* Env of every Ray container. */}}
{{- define "ray-finetune.commonEnv" -}}
- name: PYTHONUNBUFFERED
  value: "1"
{{- if .Values.storage.huggingfaceCache }}
- name: HF_HOME
  value: {{ printf "%s/.cache/huggingface" (include "ray-finetune.mountPath" . | trimSuffix "/") | quote }}
- name: HF_DATASETS_CACHE
  value: {{ printf "%s/.cache/huggingface/datasets" (include "ray-finetune.mountPath" . | trimSuffix "/") | quote }}
{{- end }}
{{- with .Values.huggingface.tokenSecret }}
{{- if .name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key | default "token" }}
{{- end }}
{{- end }}
{{- with .Values.tracking.mlflow.credentialsSecret }}
{{- $secret := . }}
{{- range list "MLFLOW_TRACKING_TOKEN" "MLFLOW_TRACKING_USERNAME" "MLFLOW_TRACKING_PASSWORD" }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ . }}
      optional: true
{{- end }}
{{- end }}
{{- if eq .Values.auth.mode "disabled" }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- if .Values.preemption.enabled }}
# The grace period the pods get: the app says at its first checkpoint whether a save fits in it.
- name: FINETUNE_GRACE_PERIOD_S
  value: {{ .Values.preemption.gracePeriodSeconds | quote }}
{{- end }}
{{- range $k, $v := .Values.ncclEnv }}
- name: {{ $k }}
  value: {{ toString $v | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Volumes of head and workers: the config, the checkpoint volume, /dev/shm of the given size and /tmp/ray, an
emptyDir with a size limit (Ray's logs and spilled objects would otherwise fill the container's writable
layer without bound). It is named ray-logs, as the one KubeRay adds for the autoscaler, which then shares it.
*/}}
{{- define "ray-finetune.volumes" -}}
- name: config
  configMap:
    name: {{ include "ray-finetune.experiment" .root }}
- name: storage
  persistentVolumeClaim:
    claimName: {{ include "ray-finetune.claimName" .root }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize | quote }}
- name: ray-logs
  emptyDir:
    sizeLimit: {{ .tmpSize | quote }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "ray-finetune.volumeMounts" -}}
- name: config
  mountPath: {{ include "ray-finetune.configDir" .root }}
  readOnly: true
- name: storage
  mountPath: {{ include "ray-finetune.mountPath" .root }}
- name: dshm
  mountPath: /dev/shm
- name: ray-logs
  mountPath: /tmp/ray
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Preemption (values: preemption): the pod's grace period, and the container's preStop hook, which the kubelet
runs before its SIGTERM (the container's PID 1, a shell running `ray start --block`, would not pass a SIGTERM
on): it asks the run to save its step in flight and stop, and waits for that within the grace period.
*/}}
{{- define "ray-finetune.gracePeriod" -}}
{{- if .Values.preemption.enabled }}
terminationGracePeriodSeconds: {{ int .Values.preemption.gracePeriodSeconds }}
{{- end }}
{{- end }}

{{- define "ray-finetune.preStop" -}}
{{- if .Values.preemption.enabled }}
lifecycle:
  preStop:
    exec:
      command:
        - finetune
        - preempt
        - {{ printf "%s/%s" (include "ray-finetune.mountPath" . | trimSuffix "/") (include "ray-finetune.experiment" .) | quote }}
        - --wait
        - {{ sub (int .Values.preemption.gracePeriodSeconds) 5 | quote }}
{{- end }}
{{- end }}

{{/* Pod metadata of head and workers: labels, and the config checksum so a changed config restarts pods. */}}
{{- define "ray-finetune.podMetadata" -}}
labels:
  {{- include "ray-finetune.selectorLabels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with .labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  checksum/config: {{ include "ray-finetune.configData" .root | sha256sum }}
  {{- with .annotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* Scheduling fields shared by head and worker pod specs. */}}
{{- define "ray-finetune.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end }}

{{- define "ray-finetune.clusterSpec" -}}
{{- $root := . -}}
{{- $exp := include "ray-finetune.experiment" . -}}
{{- $h := .Values.head -}}
rayVersion: {{ .Values.rayVersion | quote }}
{{- if eq .Values.auth.mode "token" }}
authOptions:
  mode: token
  {{- with .Values.auth.secretName }}
  secretName: {{ . }}
  {{- end }}
{{- else }}
authOptions:
  mode: disabled
{{- end }}
{{- if .Values.autoscaling.enabled }}
enableInTreeAutoscaling: true
# The autoscaler sidecar KubeRay adds to the head pod: the head container's securityContext.
autoscalerOptions:
  securityContext:
    {{- include "ray-finetune.securityContext" (dict "base" .Values.securityContext "group" $h.securityContext) | nindent 4 }}
{{- end }}
headGroupSpec:
  rayStartParams:
    {{- range $k, $v := omit ($h.rayStartParams | default dict) "num-gpus" }}
    {{ $k }}: {{ toString $v | quote }}
    {{- end }}
    # The head runs the driver and Ray Train's bookkeeping; training workers never land here.
    num-gpus: "0"
  template:
    metadata:
      {{- include "ray-finetune.podMetadata" (dict "root" . "component" "head" "labels" $h.labels "annotations" $h.annotations) | nindent 6 }}
    spec:
      {{- with include "ray-finetune.serviceAccountName" . }}
      serviceAccountName: {{ . }}
      {{- end }}
      automountServiceAccountToken: {{ include "ray-finetune.headToken" . }}
      {{- with include "ray-finetune.gracePeriod" . | trim }}{{ . | nindent 6 }}{{ end }}
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "ray-finetune.securityContext" (dict "base" .Values.podSecurityContext "group" $h.podSecurityContext) | nindent 8 }}
      {{- with include "ray-finetune.scheduling" $h | trim }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: ray-head
          image: {{ include "ray-finetune.image" (dict "root" . "override" $h.image) }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          securityContext:
            {{- include "ray-finetune.securityContext" (dict "base" .Values.securityContext "group" $h.securityContext) | nindent 12 }}
          {{- with include "ray-finetune.preStop" . | trim }}{{ . | nindent 10 }}{{ end }}
          ports:
            - containerPort: 6379
              name: gcs-server
            - containerPort: {{ include "ray-finetune.dashboardPort" . }}
              name: dashboard
            - containerPort: 10001
              name: client
          env:
            {{- include "ray-finetune.commonEnv" . | nindent 12 }}
            {{- if .Values.progressReporting.enabled }}
            # For the driver's progress reporter: which RayJob to patch.
            - name: FINETUNE_RAYJOB_NAME
              value: {{ $exp }}
            - name: FINETUNE_RAYJOB_NAMESPACE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.namespace
            {{- end }}
            {{- with $h.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- include "ray-finetune.resources" (dict "resources" $h.resources "tmpSize" ($h.tmpSize | default "20Gi")) | nindent 12 }}
          volumeMounts:
            {{- include "ray-finetune.volumeMounts" (dict "root" . "extra" $h.extraVolumeMounts) | nindent 12 }}
      volumes:
        {{- include "ray-finetune.volumes" (dict "root" . "shmSize" $h.shmSize "tmpSize" ($h.tmpSize | default "20Gi") "extra" $h.extraVolumes) | nindent 8 }}
workerGroupSpecs:
{{- range (include "ray-finetune.groups" . | fromJsonArray) }}
{{- $g := .spec }}
{{- $replicas := int ($g.replicas | default 0) }}
{{- $gpus := int ($g.gpus | default 0) }}
{{- $res := deepCopy ($g.resources | default dict) }}
{{- if gt $gpus 0 }}
{{- $_ := set $res "requests" (merge (dict ($g.gpuResource | default "nvidia.com/gpu") $gpus) ($res.requests | default dict)) }}
{{- $_ := set $res "limits" (merge (dict ($g.gpuResource | default "nvidia.com/gpu") $gpus) ($res.limits | default dict)) }}
{{- end }}
  - groupName: {{ .name }}
    replicas: {{ $replicas }}
    {{- if $root.Values.autoscaling.enabled }}
    minReplicas: {{ int ($g.minReplicas | default 0) }}
    maxReplicas: {{ int ($g.maxReplicas | default 0) }}
    {{- else }}
    minReplicas: {{ $replicas }}
    maxReplicas: {{ $replicas }}
    {{- end }}
    numOfHosts: {{ int ($g.numOfHosts | default 1) }}
    # Written as the operator writes it back: workerGroupSpecs is one atomic list for server-side apply, and
    # any difference would hand the whole list to the operator, so every later `helm upgrade` would conflict.
    scaleStrategy: {}
    rayStartParams:
      {{- range $k, $v := omit ($g.rayStartParams | default dict) "num-gpus" }}
      {{ $k }}: {{ toString $v | quote }}
      {{- end }}
      num-gpus: {{ $gpus | quote }}
    template:
      metadata:
        {{- include "ray-finetune.podMetadata" (dict "root" $root "component" (printf "worker-%s" .name) "labels" $g.labels "annotations" $g.annotations) | nindent 8 }}
      spec:
        {{- /* Ray Train's rank 0, which publishes progress on the RayJob, usually runs on a worker pod. */}}
        {{- with include "ray-finetune.serviceAccountName" $root }}
        serviceAccountName: {{ . }}
        {{- end }}
        automountServiceAccountToken: {{ $root.Values.progressReporting.enabled }}
        {{- with include "ray-finetune.gracePeriod" $root | trim }}{{ . | nindent 8 }}{{ end }}
        {{- with $root.Values.imagePullSecrets }}
        imagePullSecrets:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        securityContext:
          {{- include "ray-finetune.securityContext" (dict "base" $root.Values.podSecurityContext "group" $g.podSecurityContext) | nindent 10 }}
        {{- with include "ray-finetune.scheduling" $g | trim }}{{ . | nindent 8 }}{{ end }}
        containers:
          - name: ray-worker
            image: {{ include "ray-finetune.image" (dict "root" $root "override" $g.image) }}
            imagePullPolicy: {{ $root.Values.image.pullPolicy }}
            # KubeRay's wait-gcs-ready init container copies this securityContext.
            securityContext:
              {{- include "ray-finetune.securityContext" (dict "base" $root.Values.securityContext "group" $g.securityContext) | nindent 14 }}
            {{- with include "ray-finetune.preStop" $root | trim }}{{ . | nindent 12 }}{{ end }}
            env:
              {{- include "ray-finetune.commonEnv" $root | nindent 14 }}
              {{- with $g.env }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
            resources:
              {{- include "ray-finetune.resources" (dict "resources" $res "tmpSize" ($g.tmpSize | default "50Gi")) | nindent 14 }}
            volumeMounts:
              {{- include "ray-finetune.volumeMounts" (dict "root" $root "extra" $g.extraVolumeMounts) | nindent 14 }}
        volumes:
          {{- include "ray-finetune.volumes" (dict "root" $root "shmSize" ($g.shmSize | default "16Gi") "tmpSize" ($g.tmpSize | default "50Gi") "extra" $g.extraVolumes) | nindent 10 }}
{{- end }}
{{- end }}
