{{- define "rlrun-operator.fullname" -}}
{{- printf "%s" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rlrun-operator.selectorLabels" -}}
app.kubernetes.io/name: rlrun-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rlrun-operator.labels" -}}
{{ include "rlrun-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: rlrun
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
