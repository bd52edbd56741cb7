{{/*
The final DeepSpeed config, as app/ds_config.py build() makes it when the model config cannot be read
(validate before the model is downloaded): "auto" batch sizes, clipping, precision and optimizer values are
filled from training.*, the model-shape ones (hidden-size buckets, leaf_module.classes) stay "auto" until run start. The same problems app/ds_config.py
check() reports make the install fail here. tests/test_chart.py compares both for several value sets.
Returns JSON; fails with one line per problem.
*/}}
{{- define "ray-finetune.dsConfig" -}}
{{- $t := .Values.training -}}
{{- $tr := $t.train | default dict -}}
{{- range $k := list "micro_batch_size" "gradient_accumulation_steps" "max_grad_norm" "precision" "learning_rate" "adam_betas" "adam_eps" "weight_decay" }}
{{- if not (hasKey $tr $k) }}{{ fail (printf "training.train.%s is unset (a null in values removes the default). Fix: set a value or leave the key out of your values file" $k) }}{{ end }}
{{- end }}
{{- $ds := deepCopy ($t.deepspeed | default dict) -}}
{{- $world := include "ray-finetune.numWorkers" . | int -}}
{{- $micro := int $tr.micro_batch_size -}}
{{- $accum := int $tr.gradient_accumulation_steps -}}
{{- $precision := toString $tr.precision -}}
{{- $p := list -}}

{{- /* check(): offload keys at the top level are ignored by DeepSpeed */ -}}
{{- range $k := list "offload_param" "offload_optimizer" }}
{{- if hasKey $ds $k }}
{{- $p = append $p (printf "training.deepspeed.%s: offload settings at the top level of the DeepSpeed config are ignored by DeepSpeed (got %s). Fix: move it to training.deepspeed.zero_optimization.%s" $k (toJson (get $ds $k)) $k) }}
{{- end }}
{{- end }}
{{- $zero := dict -}}
{{- if hasKey $ds "zero_optimization" }}
{{- $zero = get $ds "zero_optimization" -}}
{{- if not (kindIs "map" $zero) }}
{{- fail (printf "training.deepspeed.zero_optimization: must be a mapping (got %s). Fix: see the DeepSpeed docs" (toJson $zero)) }}
{{- end }}
{{- end }}
{{- $stageRaw := dig "stage" 0 $zero -}}
{{- $stage := 3 -}}
{{- if and (or (kindIs "float64" $stageRaw) (kindIs "int64" $stageRaw) (kindIs "int" $stageRaw)) (eq (float64 $stageRaw) (float64 (int $stageRaw))) (ge (int $stageRaw) 0) (le (int $stageRaw) 3) }}
{{- $stage = int $stageRaw -}}
{{- else }}
{{- $p = append $p (printf "training.deepspeed.zero_optimization.stage: ZeRO stage must be 0, 1, 2 or 3 (got %s). Fix: set 0-3" (toJson $stageRaw)) }}
{{- end }}
{{- $offParam := and (kindIs "map" (dig "offload_param" "" $zero)) (not (has (toString (dig "offload_param" "device" "none" $zero)) (list "none" "<nil>"))) -}}
{{- $offOpt := and (kindIs "map" (dig "offload_optimizer" "" $zero)) (not (has (toString (dig "offload_optimizer" "device" "none" $zero)) (list "none" "<nil>"))) -}}
{{- if and $offParam (lt $stage 3) }}
{{- $p = append $p (printf "training.deepspeed.zero_optimization.offload_param: parameter offload needs ZeRO stage 3, the stage is %d (got %s). Fix: set training.deepspeed.zero_optimization.stage=3 or remove offload_param" $stage (toJson $zero.offload_param)) }}
{{- end }}
{{- if and (hasKey $zero "leaf_module") (not (kindIs "map" (get $zero "leaf_module"))) }}
{{- $p = append $p (printf "training.deepspeed.zero_optimization.leaf_module: must be a mapping (got %s). Fix: write e.g. leaf_module: {classes: auto} or {classes: [LlamaDecoderLayer]}, or remove it" (toJson (get $zero "leaf_module"))) }}
{{- end }}
{{- if and $offOpt (eq $stage 0) }}
{{- $p = append $p (printf "training.deepspeed.zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3 (got %s). Fix: raise training.deepspeed.zero_optimization.stage or remove offload_optimizer" (toJson $zero.offload_optimizer)) }}
{{- end }}

{{- /* check(): precision */ -}}
{{- $wanted := dict "bf16" (eq $precision "bf16") "fp16" (eq $precision "fp16") -}}
{{- $enabled := dict -}}
{{- range $k := list "bf16" "fp16" }}
{{- $v := false -}}
{{- if kindIs "map" (get $ds $k) }}{{ $v = dig "enabled" false (get $ds $k) }}{{ end -}}
{{- if eq (toString $v) "auto" }}
{{- $_ := set $enabled $k (get $wanted $k) -}}
{{- else }}
{{- $_ := set $enabled $k (and (not (empty $v)) (ne (toString $v) "false")) -}}
{{- end }}
{{- if not (has (toString $v) (list "auto" "true" "false")) }}
{{- $p = append $p (printf "training.deepspeed.%s.enabled: must be true, false or 'auto' (got %s). Fix: use 'auto'" $k (toJson $v)) }}
{{- end }}
{{- end }}
{{- $both := and $enabled.bf16 $enabled.fp16 -}}
{{- if $both }}
{{- $p = append $p "training.deepspeed.bf16.enabled: bf16 and fp16 are both enabled (got true). Fix: enable one: set the other to false, or both to 'auto' and choose training.train.precision" }}
{{- end }}
{{- range $k := list "bf16" "fp16" }}
{{- if and (get $enabled $k) (not (get $wanted $k)) (not $both) }}
{{- $p = append $p (printf "training.deepspeed.%s.enabled: contradicts training.train.precision=%s (got true). Fix: set training.train.precision=%s or training.deepspeed.%s.enabled='auto'" $k $precision $k $k) }}
{{- end }}
{{- end }}

{{- /* _check_batch(): explicit batch sizes must agree with training.train and the worker count */ -}}
{{- range $pair := list (list "train_micro_batch_size_per_gpu" $micro "train.micro_batch_size") (list "gradient_accumulation_steps" $accum "train.gradient_accumulation_steps") }}
{{- $v := dig (index $pair 0) "auto" $ds -}}
{{- if and (ne (toString $v) "auto") (ne (toString $v) (toString (index $pair 1))) }}
{{- $p = append $p (printf "training.deepspeed.%s: differs from training.%s=%d (got %s). Fix: set it to 'auto' (or to %d)" (index $pair 0) (index $pair 2) (index $pair 1) (toJson $v) (index $pair 1)) }}
{{- end }}
{{- end }}
{{- $expected := mul $micro $accum $world -}}
{{- $total := dig "train_batch_size" "auto" $ds -}}
{{- if and (ne (toString $total) "auto") (ne (toString $total) (toString $expected)) }}
{{- $p = append $p (printf "training.deepspeed.train_batch_size: must equal micro-batch x accumulation x workers = %d x %d x %d = %d (got %s). Fix: set it to 'auto', or change training.train.micro_batch_size / gradient_accumulation_steps / the worker count" $micro $accum $world $expected (toJson $total)) }}
{{- end }}
{{- if $p }}
{{- fail (printf "\n  %s" (join "\n  " $p)) }}
{{- end }}

{{- /* build(): fill the "auto" values */ -}}
{{- $fill := dict "train_micro_batch_size_per_gpu" $micro "gradient_accumulation_steps" $accum "train_batch_size" $expected "gradient_clipping" $tr.max_grad_norm -}}
{{- range $k, $v := $fill }}
{{- if eq (toString (dig $k "auto" $ds)) "auto" }}{{ $_ := set $ds $k $v }}{{ end }}
{{- end }}
{{- range $k := list "bf16" "fp16" }}
{{- $sec := get $ds $k -}}
{{- if and (kindIs "map" $sec) (eq (toString (dig "enabled" "" $sec)) "auto") }}{{ $_ := set $sec "enabled" (eq $precision $k) }}{{ end }}
{{- end }}
{{- if eq (toString (dig "grad_accum_dtype" "" $ds)) "auto" }}
{{- $_ := set $ds "grad_accum_dtype" (get (dict "bf16" "bf16" "fp16" "fp16" "fp32" "fp32") $precision | default "fp32") -}}
{{- end }}
{{- if and (ne $precision "bf16") (eq (toString (dig "grad_accum_dtype" "" $ds)) "bf16") }}
{{- $_ := set $ds "grad_accum_dtype" (ternary "fp32" "fp16" (eq $precision "fp32")) -}}
{{- end }}
{{- if not (hasKey $ds "zero_optimization") }}{{ $_ := set $ds "zero_optimization" dict }}{{ end -}}
{{- $zero = get $ds "zero_optimization" -}}
{{- if lt (int (dig "stage" 0 $zero)) 3 }}
{{- $_ := unset $zero "stage3_prefetch_bucket_size" -}}
{{- $_ := unset $zero "stage3_param_persistence_threshold" -}}
{{- $leaf := get $zero "leaf_module" -}}
{{- if and (kindIs "map" $leaf) (eq (toString (dig "classes" "" $leaf)) "auto") }}
{{- $_ := unset $leaf "classes" -}}
{{- if not $leaf }}{{ $_ := unset $zero "leaf_module" }}{{ end -}}
{{- end }}
{{- end }}
{{- if hasKey $ds "optimizer" }}
{{- $opt := get $ds "optimizer" -}}
{{- if not (hasKey $opt "params") }}{{ $_ := set $opt "params" dict }}{{ end -}}
{{- $params := get $opt "params" -}}
{{- $optFill := dict "lr" $tr.learning_rate "betas" (list (index $tr.adam_betas 0) (index $tr.adam_betas 1)) "eps" $tr.adam_eps "weight_decay" $tr.weight_decay -}}
{{- range $k, $v := $optFill }}
{{- if eq (toString (dig $k "" $params)) "auto" }}{{ $_ := set $params $k $v }}{{ end }}
{{- end }}
{{- end }}

{{- /* Only the model-shape values may stay "auto": the model config fills them at run start. */ -}}
{{- $derived := list "reduce_bucket_size" "stage3_prefetch_bucket_size" "prefetch_bucket_size" "stage3_param_persistence_threshold" "param_persistence_threshold" "leaf_module.classes" -}}
{{- $left := list -}}
{{- range $path := (include "ray-finetune.findAuto" (dict "node" $ds "prefix" "") | splitList "\n") }}
{{- if and $path (not (has (trimPrefix "zero_optimization." $path) $derived)) }}
{{- $left = append $left (printf "training.deepspeed.%s: no rule fills this 'auto' value (got 'auto'). Fix: set a concrete value" $path) }}
{{- end }}
{{- end }}
{{- if $left }}
{{- fail (printf "\n  %s" (join "\n  " $left)) }}
{{- end }}
{{- toJson $ds -}}
{{- end }}

{{/* Paths (a.b.c) of the "auto" values in a nested mapping, one a line. */}}
{{- define "ray-finetune.findAuto" -}}
{{- $prefix := .prefix -}}
{{- range $k, $v := .node -}}
{{- if kindIs "map" $v -}}
{{- include "ray-finetune.findAuto" (dict "node" $v "prefix" (printf "%s%s." $prefix $k)) -}}
{{- else if eq (toString $v) "auto" -}}
{{- printf "%s%s\n" $prefix $k -}}
{{- end -}}
{{- end -}}
{{- end }}
