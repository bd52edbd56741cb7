{{/*
The ConfigMap's data. training.yaml is training.* from values as the app reads it, with
experiment.storage_path set to the volume's mount path and scaling.gpu_memory, unless set, to the GPU groups'
gpuMemory (each GPU's memory, a property of the groups like the GPU count); experiment.name and scaling.num_workers are
decided by the deployment and passed on the entrypoint (--set), so one file serves every experiment.
The chart does not compute the DeepSpeed config: the app resolves it at start, logs it and records it as
<experiment>/ds_config.json (`finetune validate` prints it for a config).
*/}}
{{- define "ray-finetune.trainingConfig" -}}
{{- $t := deepCopy (.Values.training | default dict) -}}
{{- $exp := deepCopy (get $t "experiment" | default dict) -}}
{{- $_ := unset $exp "name" -}}
{{- $_ := set $exp "storage_path" (include "ray-finetune.mountPath" .) -}}
{{- $_ := set $t "experiment" $exp -}}
{{- $scaling := deepCopy (get $t "scaling" | default dict) -}}
{{- $_ := unset $scaling "num_workers" -}}
{{- with include "ray-finetune.gpuMemory" . }}{{ $_ := set $scaling "gpu_memory" . }}{{ end -}}
{{- if $scaling }}{{ $_ := set $t "scaling" $scaling }}{{ else }}{{ $_ := unset $t "scaling" }}{{ end -}}
{{- toJson $t -}}
{{- end }}

{{- define "ray-finetune.configData" -}}
training.yaml: |
  # The training config that `finetune train` reads. experiment.name and scaling.num_workers are not here:
  # the RayJob's entrypoint passes them (--set), as the deployment decides the run's identity and scale.
  {{- include "ray-finetune.toYaml" (include "ray-finetune.trainingConfig" . | fromJson) | nindent 2 }}
{{- end }}
